package fleet

import (
	"context"
	"fmt"
	"sync"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/protobuf/proto"
)

// forkNode answers ForkVirtualMachine for the one VM it has, with forks
// whose ids carry its index (as a real node's do).
type forkNode struct {
	hypervisorv1.UnimplementedHypervisorServiceServer
	parent string

	mu    sync.Mutex
	forks []*hypervisorv1.ForkVirtualMachineRequest
}

func (f *forkNode) ForkVirtualMachine(_ context.Context, req *hypervisorv1.ForkVirtualMachineRequest) (*hypervisorv1.ForkVirtualMachineResponse, error) {
	f.mu.Lock()
	f.forks = append(f.forks, proto.CloneOf(req))
	f.mu.Unlock()
	if req.GetId() != f.parent {
		return nil, poolErr(apierr.NotFound, "vm %q not found", req.GetId())
	}
	resp := &hypervisorv1.ForkVirtualMachineResponse{PauseSeconds: 0.25}
	for i := range req.GetCount() {
		resp.Vms = append(resp.Vms, &hypervisorv1.VirtualMachine{
			Id: fmt.Sprintf("%s%05x", f.parent[:3], 0x100+i), Name: fmt.Sprintf("p-fork-%d", i+1), ForkedFrom: f.parent,
		})
	}
	return resp, nil
}

func (f *forkNode) calls() []*hypervisorv1.ForkVirtualMachineRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.forks
}

func TestForkRoutesToTheParentsNode(t *testing.T) {
	a, b := &forkNode{parent: "00012345"}, &forkNode{parent: "00a12345"}
	_, h := newTestRouter(t,
		Member{Name: "n0", Index: 0, Addr: serveFake(t, a), Ready: true},
		Member{Name: "n10", Index: 10, Addr: serveFake(t, b), Ready: true},
	)
	ctx := context.Background()
	req := &hypervisorv1.ForkVirtualMachineRequest{Id: "00a12345", Count: 2, WaitFor: hypervisorv1.WaitFor_WAIT_FOR_NONE}
	resp, err := h.ForkVirtualMachine(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetVms()) != 2 || resp.GetPauseSeconds() != 0.25 {
		t.Fatalf("fork: %v", resp)
	}
	for _, vm := range resp.GetVms() {
		if vm.GetNode() != "n10" || vm.GetForkedFrom() != "00a12345" {
			t.Errorf("fork %s: node %q, forked_from %q; want n10, 00a12345", vm.GetId(), vm.GetNode(), vm.GetForkedFrom())
		}
		// The forks' ids route back to the parent's node.
		if i, _ := IndexOf(vm.GetId()); i != 10 {
			t.Errorf("fork %s: index %d, want 10", vm.GetId(), i)
		}
	}
	if got := b.calls(); len(got) != 1 || !proto.Equal(got[0], req) {
		t.Errorf("n10 got %v, want %v", got, req)
	}
	if got := a.calls(); len(got) != 0 {
		t.Errorf("n0 got %v, want nothing", got)
	}

	// The node's error is the answer; an id naming no node is not_found.
	for id, want := range map[string]apierr.Code{"00099999": apierr.NotFound, "7ff00000": apierr.NotFound} {
		if _, err := h.ForkVirtualMachine(ctx, &hypervisorv1.ForkVirtualMachineRequest{Id: id}); apierr.CodeOf(err) != want {
			t.Errorf("fork %s: %v, want %s", id, err, want)
		}
	}
}
