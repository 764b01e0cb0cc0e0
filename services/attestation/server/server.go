// Package server runs the attestation process: its locked state directory,
// its bbolt database and the AttestationService and VerifierService on a unix
// socket.
package server

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/backend"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/giantswarm/vm-manager/services/attestation/internal/apiserver"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
)

// Config is what the attestation service needs.
type Config struct {
	// StateDir holds attestation.db and attestation.lock.
	StateDir string
	// Socket is the unix socket the AttestationService is served on, in the
	// runtime directory the gateway dials.
	Socket string
	// VerifierSocket is where the VerifierService is served: for the
	// hypervisor alone, in the state directory the gateway never mounts.
	VerifierSocket string
	// Mode is "verify" or "noop".
	Mode string
	// LearnGolden accepts PCRs without a golden value (verify mode only); it
	// needs LearnGoldenAcknowledged too, since it releases user-data to boots
	// nobody has vouched for.
	LearnGolden             bool
	LearnGoldenAcknowledged bool
	// MaxNonces bounds the nonces all guests hold together (0: the default).
	MaxNonces int
	// Identity, with an issuer, requires every AttestationService call to
	// carry a valid token (the gateway forwards the caller's) and records the
	// caller on golden recordings. Health and reflection stay open. The
	// VerifierService takes no token (the hypervisor calls it on behalf of
	// guests, with no person's token to forward): its own socket, which only
	// the hypervisor can reach, is its boundary.
	Identity identity.Config
}

// Run serves until ctx ends.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	opts := apiserver.Options{LearnGolden: cfg.LearnGolden, Log: log, MaxNonces: cfg.MaxNonces}
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
	if cfg.LearnGolden && !cfg.LearnGoldenAcknowledged {
		return fmt.Errorf("--attestation-learn-golden accepts every PCR without a golden value, so VMs of an image without golden values get their user-data from boots nobody has vouched for; " +
			"set --attestation-learn-golden-acknowledge (VM_MANAGER_ATTESTATION_LEARN_GOLDEN_ACKNOWLEDGE=true) as well to confirm, for as long as it takes to record golden values")
	}
	if cfg.MaxNonces < 0 {
		return fmt.Errorf("--max-nonces=%d: want a positive number (0: the default)", cfg.MaxNonces)
	}
	if cfg.VerifierSocket == "" {
		return fmt.Errorf("the verifier socket is required")
	}
	b, err := backend.Open(ctx, "attestation", cfg.StateDir, cfg.Identity, log)
	if err != nil {
		return err
	}
	defer b.Close()
	st, err := policystore.Open(filepath.Join(cfg.StateDir, "attestation.db"))
	if err != nil {
		return err
	}
	defer st.Close()
	for _, w := range opts.Warnings() {
		log.Warn(w)
	}

	api, err := apiserver.New(st, opts)
	if err != nil {
		return err
	}
	// Two servers: what the gateway may dial (every call verified), and
	// what only the hypervisor may (on a socket outside the runtime
	// directory).
	public := mesh.NewServer(log, b.Verifier.ServerOptions()...)
	attestationv1.RegisterAttestationServiceServer(public, api)
	internal := mesh.NewServer(log)
	attestationv1.RegisterVerifierServiceServer(internal, api)
	pln, err := mesh.Listen(cfg.Socket)
	if err != nil {
		return err
	}
	vln, err := mesh.Listen(cfg.VerifierSocket)
	if err != nil {
		pln.Close()
		return err
	}
	public.SetServing()
	internal.SetServing()
	log.Info("attestation serving", "socket", cfg.Socket, "verifier_socket", cfg.VerifierSocket, "state", cfg.StateDir, "mode", cfg.Mode, "learn_golden", cfg.LearnGolden, "oidc_issuer", b.Verifier.Issuer())

	if err := mesh.ServeAll(ctx, map[*mesh.Server]net.Listener{public: pln, internal: vln}); err != nil {
		return err
	}
	log.Info("attestation stopped")
	return nil
}
