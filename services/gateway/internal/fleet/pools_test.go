package fleet

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/protobuf/proto"
)

// poolNode is a node's pools: what the pool RPCs of a fake node read and
// change.
type poolNode struct {
	hypervisorv1.UnimplementedHypervisorServiceServer

	mu      sync.Mutex
	pools   map[string]int32 // name → size
	created []*hypervisorv1.CreatePoolRequest
	resized []string
	deleted []string
}

func newPoolNode(names ...string) *poolNode {
	p := &poolNode{pools: map[string]int32{}}
	for _, n := range names {
		p.pools[n] = 1
	}
	return p
}

func poolErr(code apierr.Code, format string, args ...any) error {
	return apierr.ToStatus(apierr.Errorf(code, format, args...)).Err()
}

func (f *poolNode) CreatePool(_ context.Context, req *hypervisorv1.CreatePoolRequest) (*hypervisorv1.Pool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.created = append(f.created, proto.CloneOf(req))
	if _, ok := f.pools[req.GetName()]; ok {
		return nil, poolErr(apierr.Conflict, "pool %q exists", req.GetName())
	}
	f.pools[req.GetName()] = req.GetSize()
	return &hypervisorv1.Pool{Name: req.GetName(), Size: req.GetSize()}, nil
}

func (f *poolNode) ListPools(context.Context, *hypervisorv1.ListPoolsRequest) (*hypervisorv1.ListPoolsResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	resp := &hypervisorv1.ListPoolsResponse{}
	for name, size := range f.pools {
		resp.Pools = append(resp.Pools, &hypervisorv1.Pool{Name: name, Size: size})
	}
	return resp, nil
}

func (f *poolNode) GetPool(_ context.Context, req *hypervisorv1.GetPoolRequest) (*hypervisorv1.Pool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	size, ok := f.pools[req.GetName()]
	if !ok {
		return nil, poolErr(apierr.NotFound, "pool %q not found", req.GetName())
	}
	return &hypervisorv1.Pool{Name: req.GetName(), Size: size}, nil
}

func (f *poolNode) ResizePool(_ context.Context, req *hypervisorv1.ResizePoolRequest) (*hypervisorv1.Pool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.pools[req.GetName()]; !ok {
		return nil, poolErr(apierr.NotFound, "pool %q not found", req.GetName())
	}
	f.pools[req.GetName()] = req.GetSize()
	f.resized = append(f.resized, req.GetName())
	return &hypervisorv1.Pool{Name: req.GetName(), Size: req.GetSize()}, nil
}

func (f *poolNode) DeletePool(_ context.Context, req *hypervisorv1.DeletePoolRequest) (*hypervisorv1.DeletePoolResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.pools[req.GetName()]; !ok {
		return nil, poolErr(apierr.NotFound, "pool %q not found", req.GetName())
	}
	delete(f.pools, req.GetName())
	f.deleted = append(f.deleted, req.GetName())
	return &hypervisorv1.DeletePoolResponse{Name: req.GetName(), Deleted: true}, nil
}

func (f *poolNode) calls() (created []*hypervisorv1.CreatePoolRequest, resized, deleted []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.created, f.resized, f.deleted
}

func TestCreatePool(t *testing.T) {
	a, b := newPoolNode("taken"), newPoolNode()
	_, h := newTestRouter(t,
		Member{Name: "n0", Index: 0, Addr: serveFake(t, a), Ready: true},
		Member{Name: "n1", Index: 1, Addr: serveFake(t, b), Ready: true},
		Member{Name: "n2", Index: 2, Addr: deadAddr(t), Ready: true},
	)
	ctx := context.Background()

	// Several nodes: node is required, and named in the error.
	_, err := h.CreatePool(ctx, &hypervisorv1.CreatePoolRequest{Name: "p", Size: 2})
	var e *apierr.Error
	if apierr.CodeOf(err) != apierr.InvalidRequest || !errors.As(err, &e) || e.Metadata["field"] != "node" {
		t.Errorf("create without node: %v, want invalid_request naming node", err)
	}
	p, err := h.CreatePool(ctx, &hypervisorv1.CreatePoolRequest{Name: "p", Size: 2, Node: "n1"})
	if err != nil || p.GetNode() != "n1" || p.GetSize() != 2 {
		t.Fatalf("create on n1: %v %v", err, p)
	}
	// The node never sees the fleet's field.
	if created, _, _ := b.calls(); len(created) != 1 || created[0].GetNode() != "" || created[0].GetName() != "p" {
		t.Errorf("n1 got %v", created)
	}
	// A name another node has is a conflict naming it; nothing is created.
	_, err = h.CreatePool(ctx, &hypervisorv1.CreatePoolRequest{Name: "taken", Size: 1, Node: "n1"})
	if apierr.CodeOf(err) != apierr.Conflict || !strings.Contains(apierr.MessageOf(err), "n0") {
		t.Errorf("create of a name on n0: %v, want conflict naming n0", err)
	}
	// The target's own conflict is the node's answer.
	_, err = h.CreatePool(ctx, &hypervisorv1.CreatePoolRequest{Name: "taken", Size: 1, Node: "n0"})
	if apierr.CodeOf(err) != apierr.Conflict {
		t.Errorf("create on n0 of its own pool: %v, want conflict", err)
	}
	if created, _, _ := b.calls(); len(created) != 1 {
		t.Errorf("n1 got %d creates, want 1", len(created))
	}
	for node, code := range map[string]apierr.Code{"n9": apierr.NotFound, "n2": apierr.Unavailable} {
		if _, err := h.CreatePool(ctx, &hypervisorv1.CreatePoolRequest{Name: "q", Size: 1, Node: node}); apierr.CodeOf(err) != code {
			t.Errorf("create on %s: %v, want %s", node, err, code)
		}
	}
}

func TestCreatePoolOneNode(t *testing.T) {
	a := newPoolNode()
	_, h := newTestRouter(t, Member{Name: "only", Index: 0, Addr: serveFake(t, a), Ready: true})
	p, err := h.CreatePool(context.Background(), &hypervisorv1.CreatePoolRequest{Name: "p", Size: 1})
	if err != nil || p.GetNode() != "only" {
		t.Fatalf("create without node in a one-node fleet: %v %v", err, p)
	}
}

func TestListPools(t *testing.T) {
	a, b := newPoolNode("b-pool", "d-pool"), newPoolNode("a-pool", "c-pool")
	_, h := newTestRouter(t,
		Member{Name: "n0", Index: 0, Addr: serveFake(t, a), Ready: true},
		Member{Name: "n1", Index: 1, Addr: serveFake(t, b), Ready: true},
		Member{Name: "n2", Index: 2, Addr: deadAddr(t), Ready: true},
	)
	ctx := context.Background()
	resp, err := h.ListPools(ctx, &hypervisorv1.ListPoolsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, p := range resp.GetPools() {
		got = append(got, p.GetName()+"@"+p.GetNode())
	}
	if want := "a-pool@n1 b-pool@n0 c-pool@n1 d-pool@n0"; strings.Join(got, " ") != want {
		t.Errorf("merged %v, want %s", got, want)
	}
	if len(resp.GetWarnings()) != 1 || !strings.Contains(resp.GetWarnings()[0], "n2") {
		t.Errorf("warnings %q, want one naming n2", resp.GetWarnings())
	}
	one, err := h.ListPools(ctx, &hypervisorv1.ListPoolsRequest{Node: "n0"})
	if err != nil || len(one.GetPools()) != 2 || one.GetPools()[0].GetNode() != "n0" || len(one.GetWarnings()) != 0 {
		t.Errorf("list of n0: %v %v", err, one)
	}
}

func TestPoolByName(t *testing.T) {
	a, b := newPoolNode("mine", "twice"), newPoolNode("twice", "yours")
	_, h := newTestRouter(t,
		Member{Name: "n0", Index: 0, Addr: serveFake(t, a), Ready: true},
		Member{Name: "n1", Index: 1, Addr: serveFake(t, b), Ready: true},
	)
	ctx := context.Background()
	p, err := h.GetPool(ctx, &hypervisorv1.GetPoolRequest{Name: "yours"})
	if err != nil || p.GetNode() != "n1" {
		t.Errorf("get yours: %v %v, want on n1", err, p)
	}
	p, err = h.ResizePool(ctx, &hypervisorv1.ResizePoolRequest{Name: "mine", Size: 3})
	if err != nil || p.GetNode() != "n0" || p.GetSize() != 3 {
		t.Errorf("resize mine: %v %v", err, p)
	}
	d, err := h.DeletePool(ctx, &hypervisorv1.DeletePoolRequest{Name: "yours"})
	if err != nil || !d.GetDeleted() {
		t.Errorf("delete yours: %v %v", err, d)
	}
	if _, resized, _ := a.calls(); len(resized) != 1 {
		t.Errorf("n0 resized %v", resized)
	}
	if _, resized, deleted := b.calls(); len(resized) != 0 || len(deleted) != 1 {
		t.Errorf("n1 resized %v, deleted %v", resized, deleted)
	}

	for _, call := range []func(string) error{
		func(n string) error { _, err := h.GetPool(ctx, &hypervisorv1.GetPoolRequest{Name: n}); return err },
		func(n string) error {
			_, err := h.ResizePool(ctx, &hypervisorv1.ResizePoolRequest{Name: n, Size: 1})
			return err
		},
		func(n string) error {
			_, err := h.DeletePool(ctx, &hypervisorv1.DeletePoolRequest{Name: n})
			return err
		},
	} {
		if err := call("none"); apierr.CodeOf(err) != apierr.NotFound {
			t.Errorf("a pool no node has: %v, want not_found", err)
		}
		if err := call("twice"); apierr.CodeOf(err) != apierr.Conflict || !strings.Contains(apierr.MessageOf(err), "n0, n1") {
			t.Errorf("a pool on two nodes: %v, want conflict naming n0, n1", err)
		}
	}
	if _, _, deleted := a.calls(); len(deleted) != 0 {
		t.Errorf("n0 deleted %v", deleted)
	}
}

// A pool no node that answered has may be on the one that did not.
func TestPoolOnANodeDown(t *testing.T) {
	a := newPoolNode("mine")
	_, h := newTestRouter(t,
		Member{Name: "n0", Index: 0, Addr: serveFake(t, a), Ready: true},
		Member{Name: "n1", Index: 1, Addr: deadAddr(t), Ready: true},
	)
	ctx := context.Background()
	if p, err := h.GetPool(ctx, &hypervisorv1.GetPoolRequest{Name: "mine"}); err != nil || p.GetNode() != "n0" {
		t.Errorf("get mine: %v %v", err, p)
	}
	_, err := h.GetPool(ctx, &hypervisorv1.GetPoolRequest{Name: "other"})
	if apierr.CodeOf(err) != apierr.Unavailable || !strings.Contains(apierr.MessageOf(err), "n1") {
		t.Errorf("get other: %v, want unavailable naming n1", err)
	}
}
