package fleet

import (
	"context"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// fakeNode is a node gateway's HypervisorService at a loopback port: the
// port the router dials (a unit test's fake, the real ones are in tests/).
type fakeNode struct {
	hypervisorv1.UnimplementedHypervisorServiceServer
	host *hypervisorv1.Host
	vms  []*hypervisorv1.VirtualMachine

	mu      sync.Mutex
	created []*hypervisorv1.CreateVirtualMachineRequest
	auth    []string
}

func (f *fakeNode) GetHost(context.Context, *hypervisorv1.GetHostRequest) (*hypervisorv1.Host, error) {
	return f.host, nil
}

func (f *fakeNode) ListVirtualMachines(ctx context.Context, _ *hypervisorv1.ListVirtualMachinesRequest) (*hypervisorv1.ListVirtualMachinesResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	f.mu.Lock()
	f.auth = append(f.auth, md.Get("authorization")...)
	f.mu.Unlock()
	return &hypervisorv1.ListVirtualMachinesResponse{Vms: f.vms}, nil
}

func (f *fakeNode) GetVirtualMachine(_ context.Context, req *hypervisorv1.GetVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	for _, vm := range f.vms {
		if vm.GetId() == req.GetId() {
			return vm, nil
		}
	}
	return nil, apierr.ToStatus(apierr.Errorf(apierr.NotFound, "vm %q not found", req.GetId())).Err()
}

func (f *fakeNode) CreateVirtualMachine(_ context.Context, req *hypervisorv1.CreateVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	f.mu.Lock()
	f.created = append(f.created, req)
	f.mu.Unlock()
	return &hypervisorv1.VirtualMachine{Id: "00000001", Name: req.GetName()}, nil
}

// serveFake serves a fake HypervisorService on loopback.
func serveFake(t *testing.T, f hypervisorv1.HypervisorServiceServer) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	hypervisorv1.RegisterHypervisorServiceServer(s, f)
	go func() { _ = s.Serve(ln) }()
	t.Cleanup(s.Stop)
	return ln.Addr().String()
}

// deadAddr is a loopback address nothing listens on.
func deadAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

func vmAt(id string, sec int64, state hypervisorv1.State, cpus, mib int32) *hypervisorv1.VirtualMachine {
	return &hypervisorv1.VirtualMachine{Id: id, Name: "vm-" + id, CreatedAt: timestamppb.New(time.Unix(sec, 0)), State: state, Cpus: cpus, MemoryMib: mib}
}

func host(cpus int32, gib int64, labels map[string]string) *hypervisorv1.Host {
	return &hypervisorv1.Host{Cpus: cpus, MemoryBytes: gib << 30, Ready: true, NodeLabels: labels}
}

// newTestRouter runs a router over members and waits for its first update.
func newTestRouter(t *testing.T, members ...Member) (*Router, *Hypervisor) {
	t.Helper()
	dial, err := NewDialer("")
	if err != nil {
		t.Fatal(err)
	}
	r := NewRouter(Static(members), dial, slog.New(slog.DiscardHandler))
	r.nodeTimeout = 2 * time.Second
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = r.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	poll.Until(t, "the router's first update", func() bool {
		r.mu.RLock()
		defer r.mu.RUnlock()
		return r.known
	})
	return r, NewHypervisor(r)
}

func TestRouteByID(t *testing.T) {
	a := &fakeNode{vms: []*hypervisorv1.VirtualMachine{vmAt("00012345", 1, hypervisorv1.State_STATE_READY, 1, 512)}}
	b := &fakeNode{vms: []*hypervisorv1.VirtualMachine{vmAt("00a12345", 1, hypervisorv1.State_STATE_READY, 1, 512)}}
	_, h := newTestRouter(t,
		Member{Name: "n0", Index: 0, Addr: serveFake(t, a), Ready: true},
		Member{Name: "n10", Index: 10, Addr: serveFake(t, b), Ready: true},
		Member{Name: "n3", Index: 3, Addr: deadAddr(t), Ready: true},
		Member{Name: "n4", Index: 4, Addr: deadAddr(t), Ready: false},
		Member{Name: "n5", Index: 5, Addr: "no-port", Ready: true},
	)
	ctx := context.Background()
	for id, node := range map[string]string{"00012345": "n0", "00a12345": "n10"} {
		vm, err := h.GetVirtualMachine(ctx, &hypervisorv1.GetVirtualMachineRequest{Id: id})
		if err != nil || vm.GetNode() != node {
			t.Errorf("get %s: %v on %q, want %s", id, err, vm.GetNode(), node)
		}
	}
	for id, want := range map[string]apierr.Code{
		"00a99999": apierr.NotFound,    // the node says so
		"7ff00000": apierr.NotFound,    // no node has index 0x7ff
		"not-hex!": apierr.NotFound,    // names no index
		"00300000": apierr.Unavailable, // a node that does not answer
		"00400000": apierr.Unavailable, // a node discovery says is not ready
		"00500000": apierr.Unavailable, // a node that cannot be dialled
	} {
		_, err := h.GetVirtualMachine(ctx, &hypervisorv1.GetVirtualMachineRequest{Id: id})
		if apierr.CodeOf(err) != want {
			t.Errorf("get %s: %v, want %s", id, err, want)
		}
		if want == apierr.Unavailable && !strings.Contains(apierr.MessageOf(err), "fleet node n") {
			t.Errorf("get %s: %q does not name the node", id, apierr.MessageOf(err))
		}
	}
}

func TestListMergesAndWarns(t *testing.T) {
	a := &fakeNode{vms: []*hypervisorv1.VirtualMachine{vmAt("00000002", 2, 0, 1, 1), vmAt("00000004", 4, 0, 1, 1)}}
	b := &fakeNode{vms: []*hypervisorv1.VirtualMachine{vmAt("00100001", 1, 0, 1, 1), vmAt("00100003", 3, 0, 1, 1)}}
	_, h := newTestRouter(t,
		Member{Name: "n0", Index: 0, Addr: serveFake(t, a), Ready: true},
		Member{Name: "n1", Index: 1, Addr: serveFake(t, b), Ready: true},
		Member{Name: "n2", Index: 2, Addr: deadAddr(t), Ready: true},
	)
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", "Bearer tok"))
	resp, err := h.ListVirtualMachines(ctx, &hypervisorv1.ListVirtualMachinesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, vm := range resp.GetVms() {
		got = append(got, vm.GetId()+"@"+vm.GetNode())
	}
	if want := "00100001@n1 00000002@n0 00100003@n1 00000004@n0"; strings.Join(got, " ") != want {
		t.Errorf("merged %v, want oldest first %s", got, want)
	}
	if len(resp.GetWarnings()) != 1 || !strings.Contains(resp.GetWarnings()[0], "n2") {
		t.Errorf("warnings %q, want one naming n2", resp.GetWarnings())
	}
	// The caller's authorization reached the nodes.
	if len(a.auth) != 1 || a.auth[0] != "Bearer tok" {
		t.Errorf("node saw authorization %q", a.auth)
	}
	// One node's list.
	one, err := h.ListVirtualMachines(ctx, &hypervisorv1.ListVirtualMachinesRequest{Node: "n1"})
	if err != nil || len(one.GetVms()) != 2 || one.GetVms()[0].GetNode() != "n1" {
		t.Errorf("list of n1: %v %v", err, one)
	}
}

func TestPlacement(t *testing.T) {
	// n0: 8 GiB, 6 taken by a running VM; n1: 8 GiB, 2 taken (a stopped VM
	// takes nothing); n2: the most memory, but labelled otherwise.
	n0 := &fakeNode{host: host(8, 8, map[string]string{"pool": "a"}), vms: []*hypervisorv1.VirtualMachine{vmAt("00000001", 1, hypervisorv1.State_STATE_READY, 2, 6144)}}
	n1 := &fakeNode{host: host(8, 8, map[string]string{"pool": "a"}), vms: []*hypervisorv1.VirtualMachine{
		vmAt("00100001", 1, hypervisorv1.State_STATE_RUNNING, 2, 2048), vmAt("00100002", 1, hypervisorv1.State_STATE_STOPPED, 2, 4096)}}
	n2 := &fakeNode{host: host(8, 32, map[string]string{"pool": "b"})}
	_, h := newTestRouter(t,
		Member{Name: "n0", Index: 0, Addr: serveFake(t, n0), Ready: true},
		Member{Name: "n1", Index: 1, Addr: serveFake(t, n1), Ready: true},
		Member{Name: "n2", Index: 2, Addr: serveFake(t, n2), Ready: true},
		Member{Name: "n3", Index: 3, Addr: deadAddr(t), Ready: true}, // skipped
	)
	ctx := context.Background()
	mib := func(v int32) *int32 { return &v }
	for _, tc := range []struct {
		req  *hypervisorv1.CreateVirtualMachineRequest
		want string
		code apierr.Code
	}{
		{req: &hypervisorv1.CreateVirtualMachineRequest{Name: "x"}, want: "n2"},
		{req: &hypervisorv1.CreateVirtualMachineRequest{Name: "x", NodeSelector: "pool=a"}, want: "n1"},
		{req: &hypervisorv1.CreateVirtualMachineRequest{Name: "x", Node: "n0"}, want: "n0"},
		{req: &hypervisorv1.CreateVirtualMachineRequest{Name: "x", NodeSelector: "pool=a", MemoryMib: mib(7000)}, code: apierr.ResourceExhausted},
		{req: &hypervisorv1.CreateVirtualMachineRequest{Name: "x", NodeSelector: "pool=c"}, code: apierr.ResourceExhausted},
		{req: &hypervisorv1.CreateVirtualMachineRequest{Name: "x", NodeSelector: "pool"}, code: apierr.InvalidRequest},
		{req: &hypervisorv1.CreateVirtualMachineRequest{Name: "x", Node: "n9"}, code: apierr.NotFound},
	} {
		vm, err := h.CreateVirtualMachine(ctx, tc.req)
		if tc.code != "" {
			if apierr.CodeOf(err) != tc.code {
				t.Errorf("create %v: %v, want %s", tc.req, err, tc.code)
			}
			if tc.code == apierr.ResourceExhausted && !strings.Contains(apierr.MessageOf(err), "node n3 did not answer") {
				t.Errorf("create %v: %q does not name the node that did not answer", tc.req, apierr.MessageOf(err))
			}
			continue
		}
		if err != nil || vm.GetNode() != tc.want {
			t.Errorf("create %v: %v on %q, want %s", tc.req, err, vm.GetNode(), tc.want)
		}
	}
	// The node never sees the fleet's fields.
	for _, n := range []*fakeNode{n0, n1, n2} {
		for _, req := range n.created {
			if req.GetNode() != "" || req.GetNodeSelector() != "" {
				t.Errorf("a node got %v", req)
			}
		}
	}
	sum, err := h.GetHost(ctx, &hypervisorv1.GetHostRequest{})
	if err != nil || sum.GetCpus() != 24 || len(sum.GetFleetNodes()) != 4 || sum.GetFleetNodes()[0].GetAllocatedMemoryBytes() != 6144<<20 ||
		sum.GetFleetNodes()[3].GetAvailable() || len(sum.GetWarnings()) != 1 {
		t.Errorf("fleet summary: %v %v", err, sum)
	}
}

func TestDialerRefusesPlaintextBeyondLoopback(t *testing.T) {
	dial, err := NewDialer("")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dial(Member{Name: "n", Addr: "10.0.0.1:8443"}); err == nil || !strings.Contains(err.Error(), "loopback") {
		t.Errorf("plaintext to 10.0.0.1: %v", err)
	}
	for _, addr := range []string{"127.0.0.1:1", "localhost:1", "[::1]:1"} {
		conn, err := dial(Member{Name: "n", Addr: addr})
		if err != nil {
			t.Errorf("plaintext to %s: %v", addr, err)
			continue
		}
		conn.Close()
	}
	if _, err := NewDialer("/nonexistent/ca.pem"); err == nil {
		t.Error("a missing CA file is accepted")
	}
}

func (f *fakeNode) WatchVirtualMachines(req *hypervisorv1.WatchVirtualMachinesRequest, ss grpc.ServerStreamingServer[hypervisorv1.WatchVirtualMachinesResponse]) error {
	for _, vm := range f.vms {
		if err := ss.Send(&hypervisorv1.WatchVirtualMachinesResponse{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SNAPSHOT, Revision: 7, Vm: vm}); err != nil {
			return err
		}
	}
	if err := ss.Send(&hypervisorv1.WatchVirtualMachinesResponse{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED, Revision: 7}); err != nil {
		return err
	}
	<-ss.Context().Done()
	return nil
}

// watchSink is the server side of a fleet watch, collecting what it sends.
type watchSink struct {
	grpc.ServerStream
	ctx    context.Context
	events chan *hypervisorv1.WatchVirtualMachinesResponse
}

func (w *watchSink) Context() context.Context { return w.ctx }
func (w *watchSink) Send(ev *hypervisorv1.WatchVirtualMachinesResponse) error {
	w.events <- ev
	return nil
}

// A fleet watch: every node's snapshot, one SYNCED once all answered or
// failed, a WARNING naming the node that did not, revisions of its own;
// a resume is refused.
func TestWatchMerges(t *testing.T) {
	a := &fakeNode{vms: []*hypervisorv1.VirtualMachine{vmAt("00000001", 1, 0, 1, 1)}}
	b := &fakeNode{vms: []*hypervisorv1.VirtualMachine{vmAt("00100001", 1, 0, 1, 1), vmAt("00100002", 2, 0, 1, 1)}}
	_, h := newTestRouter(t,
		Member{Name: "n0", Index: 0, Addr: serveFake(t, a), Ready: true},
		Member{Name: "n1", Index: 1, Addr: serveFake(t, b), Ready: true},
		Member{Name: "n2", Index: 2, Addr: deadAddr(t), Ready: true},
	)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sink := &watchSink{ctx: ctx, events: make(chan *hypervisorv1.WatchVirtualMachinesResponse, 16)}
	done := make(chan error, 1)
	go func() { done <- h.WatchVirtualMachines(&hypervisorv1.WatchVirtualMachinesRequest{}, sink) }()
	snap, warned := map[string]string{}, false
	var last uint64
	for synced := false; !synced; {
		select {
		case ev := <-sink.events:
			if ev.GetRevision() <= last {
				t.Errorf("revision %d after %d", ev.GetRevision(), last)
			}
			last = ev.GetRevision()
			switch ev.GetType() {
			case hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SNAPSHOT:
				snap[ev.GetVm().GetId()] = ev.GetVm().GetNode()
			case hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_WARNING:
				warned = warned || strings.Contains(ev.GetWarning(), "n2")
			case hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED:
				synced = true
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no SYNCED")
		}
	}
	if len(snap) != 3 || snap["00100002"] != "n1" || snap["00000001"] != "n0" {
		t.Errorf("snapshot %v", snap)
	}
	if !warned {
		// The warning may follow SYNCED: the dead node's first failure
		// counts as its sync.
		select {
		case ev := <-sink.events:
			warned = ev.GetType() == hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_WARNING && strings.Contains(ev.GetWarning(), "n2")
		case <-time.After(5 * time.Second):
		}
		if !warned {
			t.Error("no WARNING naming n2")
		}
	}
	cancel()
	<-done
	err := h.WatchVirtualMachines(&hypervisorv1.WatchVirtualMachinesRequest{SinceRevision: 3}, &watchSink{ctx: context.Background()})
	if apierr.CodeOf(err) != apierr.OutOfRange {
		t.Errorf("fleet resume: %v, want out_of_range", err)
	}
}

// chanDiscovery reports each member set sent on it.
type chanDiscovery chan []Member

func (c chanDiscovery) Run(ctx context.Context, update func([]Member)) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case ms := <-c:
			update(ms)
		}
	}
}

// Discovery's changes take effect: a node turning not ready answers
// unavailable, a node moving to another address is dialled there, a node
// gone is unavailable and named in lists until its retention ends, then
// not_found.
func TestMembershipChanges(t *testing.T) {
	a := &fakeNode{vms: []*hypervisorv1.VirtualMachine{vmAt("00012345", 1, 0, 1, 1)}}
	moved := &fakeNode{vms: []*hypervisorv1.VirtualMachine{vmAt("00012345", 1, 0, 1, 1), vmAt("00067890", 1, 0, 1, 1)}}
	addrA, addrMoved := serveFake(t, a), serveFake(t, moved)
	dial, _ := NewDialer("")
	disc := make(chanDiscovery)
	r := NewRouter(disc, dial, slog.New(slog.DiscardHandler))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = r.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	h := NewHypervisor(r)
	get := func(id string) apierr.Code {
		_, err := h.GetVirtualMachine(context.Background(), &hypervisorv1.GetVirtualMachineRequest{Id: id})
		if err == nil {
			return "ok"
		}
		return apierr.CodeOf(err)
	}
	for _, step := range []struct {
		members []Member
		id      string
		want    apierr.Code
	}{
		{[]Member{{Name: "n0", Index: 0, Addr: addrA, Ready: true}}, "00012345", "ok"},
		{[]Member{{Name: "n0", Index: 0, Addr: addrA, Ready: false}}, "00012345", apierr.Unavailable},
		{[]Member{{Name: "n0", Index: 0, Addr: addrMoved, Ready: true}}, "00067890", "ok"},
		// Gone from discovery (a pod being recreated has no endpoint):
		// unavailable for the retention, not a not_found.
		{nil, "00067890", apierr.Unavailable},
	} {
		disc <- step.members
		// The update is applied before the next receive on disc returns.
		disc <- step.members
		if got := get(step.id); got != step.want {
			t.Errorf("members %v: get %s = %s, want %s", step.members, step.id, got, step.want)
		}
	}
	list, err := h.ListVirtualMachines(context.Background(), &hypervisorv1.ListVirtualMachinesRequest{})
	if err != nil || len(list.GetWarnings()) != 1 || !strings.Contains(list.GetWarnings()[0], "n0") {
		t.Errorf("list with n0 gone: %v, warnings %q; want one naming n0", err, list.GetWarnings())
	}
	// Past the retention it is forgotten: not_found, no warning.
	r.mu.Lock()
	r.goneRetention = time.Nanosecond
	r.mu.Unlock()
	if got := get("00067890"); got != apierr.NotFound {
		t.Errorf("gone past retention: get = %s, want not_found", got)
	}
	if list, err := h.ListVirtualMachines(context.Background(), &hypervisorv1.ListVirtualMachinesRequest{}); err != nil || len(list.GetWarnings()) != 0 {
		t.Errorf("list past retention: %v, warnings %q; want none", err, list.GetWarnings())
	}
}

// fakeAttestation is a node's AttestationService with fixed policies.
type fakeAttestation struct {
	attestationv1.UnimplementedAttestationServiceServer
	policies []*attestationv1.ImagePolicy
}

func (f *fakeAttestation) ListImagePolicies(context.Context, *attestationv1.ListImagePoliciesRequest) (*attestationv1.ListImagePoliciesResponse, error) {
	return &attestationv1.ListImagePoliciesResponse{Policies: f.policies}, nil
}

func serveAttestation(t *testing.T, f *fakeAttestation) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	attestationv1.RegisterAttestationServiceServer(s, f)
	go func() { _ = s.Serve(ln) }()
	t.Cleanup(s.Stop)
	return ln.Addr().String()
}

// Fleet-wide policies that drifted apart are a warning naming the nodes,
// each image listed once.
func TestPoliciesDrift(t *testing.T) {
	doc := func(v string) *structpb.Struct {
		s, _ := structpb.NewStruct(map[string]any{"pcr11": map[string]any{"x": v}})
		return s
	}
	a := &fakeAttestation{policies: []*attestationv1.ImagePolicy{{Image: "i_1", Document: doc("a")}, {Image: "j_1", Document: doc("a")}}}
	b := &fakeAttestation{policies: []*attestationv1.ImagePolicy{{Image: "i_1", Document: doc("a")}, {Image: "j_1", Document: doc("b")}}}
	c := &fakeAttestation{policies: []*attestationv1.ImagePolicy{{Image: "i_1", Document: doc("a")}}}
	r, _ := newTestRouter(t,
		Member{Name: "n0", Index: 0, Addr: serveAttestation(t, a), Ready: true},
		Member{Name: "n1", Index: 1, Addr: serveAttestation(t, b), Ready: true},
		Member{Name: "n2", Index: 2, Addr: serveAttestation(t, c), Ready: true},
	)
	resp, err := NewAttestation(r).ListImagePolicies(context.Background(), &attestationv1.ListImagePoliciesRequest{})
	if err != nil || len(resp.GetPolicies()) != 2 {
		t.Fatalf("policies: %v %v", err, resp)
	}
	if w := resp.GetWarnings(); len(w) != 1 || !strings.Contains(w[0], "policy j_1 is missing or different on n1, n2") {
		t.Errorf("warnings %q", w)
	}
}
