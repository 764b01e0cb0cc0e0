package mesh_test

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

const hvDown = "the hypervisor service is unavailable: "

// wantNamedUnavailable checks err is the domain error unavailable naming
// the hypervisor, as a status with an ErrorInfo.
func wantNamedUnavailable(t *testing.T, what string, err error) {
	t.Helper()
	if status.Code(err) != codes.Unavailable || !apierr.HasErrorInfo(err) || info(t, err).GetReason() != "unavailable" {
		t.Errorf("%s: %v, want the domain error unavailable", what, err)
	}
	if msg := apierr.MessageOf(err); !strings.HasPrefix(msg, hvDown) || len(msg) == len(hvDown) {
		t.Errorf("%s: message %q, want %q and gRPC's reason", what, msg, hvDown+"…")
	}
}

func TestDialBackendNamesTheDownBackend(t *testing.T) {
	conn, err := mesh.DialBackend(filepath.Join(shortDir(t), "nobody.sock"), "hypervisor")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	_, err = hc.Check(ctx(t), &healthpb.HealthCheckRequest{})
	wantNamedUnavailable(t, "unary", err)

	// A stream fails when it opens or at its first message, named either way.
	w, err := hc.Watch(ctx(t), &healthpb.HealthCheckRequest{})
	if err == nil {
		_, err = w.Recv()
	}
	wantNamedUnavailable(t, "stream", err)
}

// What a backend that is up says, its own unavailable included, reaches the
// caller unchanged: the backend is not the one that is down.
func TestDialBackendPassesWhatTheBackendSaid(t *testing.T) {
	_, conn, _ := startServerDial(t, func(path string) (*grpc.ClientConn, error) { return mesh.DialBackend(path, "hypervisor") })
	hv := hypervisorv1.NewHypervisorServiceClient(conn)
	_, err := hv.GetVirtualMachine(ctx(t), &hypervisorv1.GetVirtualMachineRequest{})
	if apierr.CodeOf(err) != apierr.Unavailable || apierr.MessageOf(err) != "no attestation service" {
		t.Errorf("GetVirtualMachine: %v, want the backend's own unavailable unchanged", err)
	}
	_, err = hv.GetHost(ctx(t), &hypervisorv1.GetHostRequest{})
	if apierr.CodeOf(err) != apierr.Conflict || apierr.MessageOf(err) != "x" {
		t.Errorf("GetHost: %v, want the backend's conflict unchanged", err)
	}
	_, err = hv.ListImages(ctx(t), &hypervisorv1.ListImagesRequest{})
	if status.Code(err) != codes.Unimplemented {
		t.Errorf("ListImages: %v, want Unimplemented unchanged", err)
	}
}

func TestUnreachable(t *testing.T) {
	live := context.Background()
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	closing := status.Error(codes.Canceled, "grpc: the client connection is closing")
	sent := apierr.ToStatus(apierr.Errorf(apierr.Unavailable, "vm x: cannot reach SSH")).Err()
	for _, tc := range []struct {
		name  string
		ctx   context.Context
		err   error
		named bool
	}{
		{"nil", live, nil, false},
		{"transport unavailable", live, status.Error(codes.Unavailable, "connection error"), true},
		{"connection closed under the call", live, closing, true},
		{"caller gave up", gone, status.Error(codes.Canceled, "context canceled"), false},
		{"deadline", live, status.Error(codes.DeadlineExceeded, "context deadline exceeded"), false},
		{"the backend's own unavailable", live, sent, false},
		{"not a status", live, errors.New("boom"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := mesh.Unreachable(tc.ctx, "hypervisor", tc.err)
			if tc.named {
				wantNamedUnavailable(t, tc.name, got)
				if want := hvDown + status.Convert(tc.err).Message(); apierr.MessageOf(got) != want {
					t.Errorf("message %q, want %q", apierr.MessageOf(got), want)
				}
				return
			}
			if got != tc.err {
				t.Errorf("Unreachable changed %v into %v", tc.err, got)
			}
		})
	}
}
