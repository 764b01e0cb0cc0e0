package fleet

import (
	"context"
	"log/slog"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// healthEvery is how often the router's health (the fleet gateway's
// readiness) is refreshed from the nodes'.
const healthEvery = 2 * time.Second

// Serve serves the fleet's HypervisorService and AttestationService on the
// unix socket at path, for the gateway's ordinary surfaces (gRPC
// forwarder, REST, MCP, watch, exec WebSocket) to use as their backend,
// until ctx ends. Its health is SERVING while at least one node answers.
func (r *Router) Serve(ctx context.Context, path string, log *slog.Logger) error {
	srv := mesh.NewServer(log)
	hypervisorv1.RegisterHypervisorServiceServer(srv, NewHypervisor(r))
	attestationv1.RegisterAttestationServiceServer(srv, NewAttestation(r))
	ln, err := mesh.Listen(path)
	if err != nil {
		return err
	}
	go func() {
		for {
			st := healthpb.HealthCheckResponse_SERVING
			if err := r.Healthy(ctx); err != nil {
				st = healthpb.HealthCheckResponse_NOT_SERVING
			}
			for name := range srv.GetServiceInfo() {
				srv.Health.SetServingStatus(name, st)
			}
			srv.Health.SetServingStatus("", st)
			select {
			case <-ctx.Done():
				return
			case <-time.After(healthEvery):
			}
		}
	}()
	return srv.ServeUntil(ctx, ln)
}
