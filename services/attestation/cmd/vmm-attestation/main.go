// Command vmm-attestation verifies TPM quotes against golden PCR policy kept
// in bbolt, served as gRPC on a unix socket.
package main

import (
	"cmp"
	"context"
	"log/slog"
	"os"
	"path/filepath"

	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/giantswarm/vm-manager/pkg/observe"
	"github.com/giantswarm/vm-manager/pkg/statedir"
	"github.com/giantswarm/vm-manager/pkg/tracing"
	"github.com/giantswarm/vm-manager/services/attestation/internal/nonce"
	"github.com/giantswarm/vm-manager/services/attestation/server"
)

func main() {
	os.Exit(cli.Main("vmm-attestation", "vm-manager's attestation service (quotes, golden PCR policy)", os.Args[1:], os.Stderr, cli.Command{
		Name:  "serve",
		Usage: "serve the AttestationService and VerifierService on a unix socket",
		Setup: func(fs *cli.FlagSet) func(context.Context) error {
			stateDir := fs.String("state-dir", "VM_MANAGER_STATE_DIR", statedir.Default(), "state directory (attestation.db)")
			runDir := fs.String("run-dir", "VM_MANAGER_RUN_DIR", mesh.DefaultRunDir(), "runtime directory for the unix sockets")
			socket := fs.String("socket", "VM_MANAGER_ATTESTATION_SOCKET", "", "socket to serve the AttestationService on (default <run-dir>/"+mesh.AttestationSocket+")")
			verifierSocket := fs.String("verifier-socket", "VM_MANAGER_VERIFIER_SOCKET", "", "socket to serve the hypervisor-only VerifierService on, outside the gateway's reach (default <state-dir>/"+mesh.VerifierSocket+")")
			mode := fs.String("attestation", "VM_MANAGER_ATTESTATION", "verify", "verify quotes against policy, or noop (accept any quote with a valid nonce)")
			learn := fs.Bool("attestation-learn-golden", "VM_MANAGER_ATTESTATION_LEARN_GOLDEN", false, "accept PCRs without a golden value and report them as learned (needs --attestation-learn-golden-acknowledge)")
			learnAck := fs.Bool("attestation-learn-golden-acknowledge", "VM_MANAGER_ATTESTATION_LEARN_GOLDEN_ACKNOWLEDGE", false, "confirm learn mode: boots nobody has vouched for get their user-data while it is on")
			maxNonces := fs.Int("max-nonces", "VM_MANAGER_MAX_NONCES", nonce.DefaultMax, "outstanding attestation nonces of all VMs together, kept in memory; at the bound the oldest is dropped (counted in GET /api/v1/attestation)")
			oidc := identity.Flags(fs)
			serve := observe.Flags(fs, "info", "attestation", tracing.Attestation, false)
			return serve(func(ctx context.Context, log *slog.Logger) error {
				sock := cmp.Or(*socket, filepath.Join(*runDir, mesh.AttestationSocket))
				vsock := cmp.Or(*verifierSocket, filepath.Join(*stateDir, mesh.VerifierSocket))
				return server.Run(ctx, server.Config{StateDir: *stateDir, Socket: sock, VerifierSocket: vsock, Mode: *mode,
					LearnGolden: *learn, LearnGoldenAcknowledged: *learnAck, MaxNonces: *maxNonces, Identity: oidc()}, log)
			})
		},
	}))
}
