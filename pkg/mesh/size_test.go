package mesh_test

import (
	"context"
	"log/slog"
	"path/filepath"
	"strings"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/mesh"
)

type echoHypervisor struct {
	hypervisorv1.UnimplementedHypervisorServiceServer
}

func (echoHypervisor) CreateVirtualMachine(_ context.Context, req *hypervisorv1.CreateVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return &hypervisorv1.VirtualMachine{Name: req.GetName(), LastError: req.GetUserData()}, nil
}

// TestMessagesAsLargeAsTheAPIAccepts: issue 8 found a REST body under the
// 8 MiB limit failing with 500 internal_error ("grpc: received message larger
// than max (8388563 vs. 4194304)") between the gateway and the hypervisor.
func TestMessagesAsLargeAsTheAPIAccepts(t *testing.T) {
	path := filepath.Join(shortDir(t), mesh.HypervisorSocket)
	l, err := mesh.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	srv := mesh.NewServer(slog.New(slog.DiscardHandler))
	hypervisorv1.RegisterHypervisorServiceServer(srv, echoHypervisor{})
	go srv.Serve(l)
	t.Cleanup(srv.Stop)
	conn, err := mesh.Dial(path)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ud := strings.Repeat("x", 8<<20) // both ways: the request, and a response as large
	vm, err := hypervisorv1.NewHypervisorServiceClient(conn).CreateVirtualMachine(ctx(t), &hypervisorv1.CreateVirtualMachineRequest{Name: "big", UserData: ud})
	if err != nil {
		t.Fatalf("an 8 MiB message: %v", err)
	}
	if len(vm.GetLastError()) != len(ud) {
		t.Fatalf("echoed %d bytes", len(vm.GetLastError()))
	}
}
