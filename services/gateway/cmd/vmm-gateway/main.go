// Command vmm-gateway is vm-manager's front door: the public gRPC API, REST
// and the OpenAPI document on one TCP address, forwarding to the hypervisor
// and attestation processes over unix sockets.
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
	"github.com/giantswarm/vm-manager/pkg/tracing"
	"github.com/giantswarm/vm-manager/services/gateway/server"
)

func main() {
	os.Exit(cli.Main("vmm-gateway", "vm-manager's API gateway (gRPC, REST, OpenAPI)", os.Args[1:], os.Stderr, cli.Command{
		Name:  "serve",
		Usage: "serve the public API on one TCP address",
		Setup: func(fs *cli.FlagSet) func(context.Context) error {
			listen := fs.String("listen", "VM_MANAGER_LISTEN", "127.0.0.1:8080", "TCP address for gRPC, REST and health")
			runDir := fs.String("run-dir", "VM_MANAGER_RUN_DIR", mesh.DefaultRunDir(), "runtime directory holding the backends' unix sockets")
			hvSock := fs.String("hypervisor-socket", "VM_MANAGER_HYPERVISOR_SOCKET", "", "hypervisor socket (default <run-dir>/"+mesh.HypervisorSocket+")")
			atSock := fs.String("attestation-socket", "VM_MANAGER_ATTESTATION_SOCKET", "", "attestation socket (default <run-dir>/"+mesh.AttestationSocket+")")
			allow := fs.Bool("allow-anonymous-non-loopback", "VM_MANAGER_ALLOW_ANONYMOUS_NON_LOOPBACK", false, "let the anonymous API listen on a non-loopback address")
			allowedHosts := fs.StringList("allowed-hosts", "VM_MANAGER_ALLOWED_HOSTS", nil, "names (any port) or name:port the anonymous API answers besides its listen address and localhost with its port, comma-separated; other Host and Origin headers are refused (DNS rebinding, cross-site pages)")
			oidc := identity.Flags(fs)
			resource := identity.ResourceFlags(fs)
			tlsCert := fs.String("tls-cert-file", "VM_MANAGER_TLS_CERT_FILE", "", "serve gRPC, REST and MCP over TLS on --listen with this certificate (PEM; with --tls-key-file)")
			tlsKey := fs.String("tls-key-file", "VM_MANAGER_TLS_KEY_FILE", "", "the private key (PEM) of --tls-cert-file")
			fleetMode := fleetFlags(fs)
			metricsOn := fs.Bool("metrics-enabled", "VM_MANAGER_METRICS_ENABLED", false, "serve Prometheus metrics at /metrics (VMs, networks, requests per surface)")
			serve := observe.Flags(fs, "info", "gateway", tracing.Gateway, true)
			return serve(func(ctx context.Context, log *slog.Logger) error {
				disc, caFile, err := fleetMode(log)
				if err != nil {
					return err
				}
				cfg := server.Config{
					Listen:            *listen,
					HypervisorSocket:  cmp.Or(*hvSock, filepath.Join(*runDir, mesh.HypervisorSocket)),
					AttestationSocket: cmp.Or(*atSock, filepath.Join(*runDir, mesh.AttestationSocket)),
					AllowNonLoopback:  *allow,
					AllowedHosts:      *allowedHosts,
					Identity:          oidc(),
					Resource:          resource(),
					MetricsEnabled:    *metricsOn,
					TLSCertFile:       *tlsCert,
					TLSKeyFile:        *tlsKey,
				}
				if disc == nil {
					return server.Run(ctx, cfg, log)
				}
				// Fleet mode: the ordinary gateway over the fleet router,
				// which stands in for both backends.
				ctx, cancel := context.WithCancel(ctx)
				defer cancel()
				router, sock, fleetErr, err := startFleet(ctx, disc, caFile, *runDir, log)
				if err != nil {
					return err
				}
				cfg.HypervisorSocket, cfg.AttestationSocket, cfg.Fleet, cfg.Readiness = sock, sock, true, router.Healthy
				done := make(chan error, 1)
				go func() { done <- server.Run(ctx, cfg, log) }()
				select {
				case err := <-done:
					return err
				case err := <-fleetErr:
					// The router ends early only on an error (a socket in
					// use); with ctx it ends as the gateway drains.
					cancel()
					if serr := <-done; err == nil {
						return serr
					}
					return err
				}
			})
		},
	}))
}
