// Package server runs the attestation process: its locked state directory,
// its bbolt database and the AttestationService and VerifierService on a unix
// socket.
package server

import (
	"context"
	"fmt"
	"log/slog"
	"path/filepath"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/giantswarm/vm-manager/pkg/statedir"
	"github.com/giantswarm/vm-manager/services/attestation/internal/apiserver"
	"github.com/giantswarm/vm-manager/services/attestation/internal/store"
)

// Config is what the attestation service needs.
type Config struct {
	// StateDir holds attestation.db and attestation.lock.
	StateDir string
	// Socket is the unix socket to serve on.
	Socket string
	// Mode is "verify" or "noop".
	Mode string
	// LearnGolden accepts PCRs without a golden value (verify mode only).
	LearnGolden bool
	// Identity, with an issuer, requires every AttestationService call to
	// carry a valid token (the gateway forwards the caller's) and records the
	// caller on golden recordings. Health, reflection and the pod-internal
	// VerifierService stay open: the hypervisor calls the latter on behalf of
	// guests, with no person's token to forward; the socket's 0600 mode in its
	// 0700 directory guards it.
	Identity identity.Config
}

// Run serves until ctx ends.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	opts := apiserver.Options{LearnGolden: cfg.LearnGolden, Log: log}
	switch cfg.Mode {
	case "verify", "":
		opts.Mode = attestationv1.Mode_MODE_VERIFY
	case "noop":
		opts.Mode = attestationv1.Mode_MODE_NOOP
		if cfg.LearnGolden {
			return fmt.Errorf("--attestation-learn-golden requires --attestation=verify")
		}
	default:
		return fmt.Errorf("--attestation=%q: want verify or noop", cfg.Mode)
	}
	if cfg.Identity.Log == nil {
		cfg.Identity.Log = log
	}
	verifier, err := identity.New(ctx, cfg.Identity)
	if err != nil {
		return err
	}
	lock, err := statedir.Acquire(cfg.StateDir, "attestation")
	if err != nil {
		return err
	}
	defer lock.Release()
	st, err := store.Open(filepath.Join(cfg.StateDir, "attestation.db"))
	if err != nil {
		return err
	}
	defer st.Close()
	for _, w := range opts.Warnings() {
		log.Warn(w)
	}

	srv := mesh.NewServer(log, verifier.ServerOptions(attestationv1.VerifierService_ServiceDesc.ServiceName)...)
	api := apiserver.New(st, opts)
	attestationv1.RegisterAttestationServiceServer(srv, api)
	attestationv1.RegisterVerifierServiceServer(srv, api)
	ln, err := mesh.Listen(cfg.Socket)
	if err != nil {
		return err
	}
	srv.SetServing()
	log.Info("attestation serving", "socket", cfg.Socket, "state", cfg.StateDir, "mode", cfg.Mode, "learn_golden", cfg.LearnGolden, "oidc_issuer", verifier.Issuer())

	if err := srv.ServeUntil(ctx, ln); err != nil {
		return err
	}
	log.Info("attestation stopped")
	return nil
}
