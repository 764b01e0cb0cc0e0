package fleet

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// importNode is a node's ImportImage: RESOLVING, LAYERS (bytes of its own),
// then DONE or fail; with block, RESOLVING then a wait for the call's end.
type importNode struct {
	hypervisorv1.UnimplementedHypervisorServiceServer
	bytes     int64
	unchanged bool
	fail      error
	block     bool

	mu    sync.Mutex
	reqs  []*hypervisorv1.ImportImageRequest
	ended chan struct{} // closed when a blocked call's context ends
}

func (f *importNode) ImportImage(req *hypervisorv1.ImportImageRequest, ss grpc.ServerStreamingServer[hypervisorv1.ImportImageResponse]) error {
	f.mu.Lock()
	f.reqs = append(f.reqs, proto.CloneOf(req))
	f.mu.Unlock()
	if err := ss.Send(&hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_RESOLVING}); err != nil {
		return err
	}
	if f.block {
		<-ss.Context().Done()
		close(f.ended)
		return ss.Context().Err()
	}
	if err := ss.Send(&hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS, BytesDone: f.bytes, BytesTotal: f.bytes, Layer: "sha256:ab12"}); err != nil {
		return err
	}
	if f.fail != nil {
		return apierr.ToStatus(f.fail).Err()
	}
	return ss.Send(&hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_DONE, Unchanged: f.unchanged,
		Image: &hypervisorv1.Image{Id: req.GetId(), Version: "1", Ref: req.GetId() + "_1"}})
}

func (f *importNode) requests() []*hypervisorv1.ImportImageRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.reqs
}

// importSink is the server side of a fleet ImportImage, collecting what it
// sends.
type importSink struct {
	grpc.ServerStream
	ctx  context.Context
	msgs chan *hypervisorv1.ImportImageResponse
}

func (s *importSink) Context() context.Context { return s.ctx }
func (s *importSink) Send(m *hypervisorv1.ImportImageResponse) error {
	s.msgs <- m
	return nil
}

// runImport runs a fleet ImportImage to its end: what it sent, and its error.
func runImport(t *testing.T, h *Hypervisor, req *hypervisorv1.ImportImageRequest) ([]*hypervisorv1.ImportImageResponse, error) {
	t.Helper()
	sink := &importSink{ctx: context.Background(), msgs: make(chan *hypervisorv1.ImportImageResponse, 64)}
	done := make(chan error, 1)
	go func() { done <- h.ImportImage(req, sink) }()
	select {
	case err := <-done:
		close(sink.msgs)
		var out []*hypervisorv1.ImportImageResponse
		for m := range sink.msgs {
			out = append(out, m)
		}
		return out, err
	case <-time.After(poll.Bound):
		t.Fatal("the fleet import did not end")
	}
	return nil, nil
}

// With node, the stream is the named node's, relayed as it comes, the image
// naming its node; the node never sees the fleet's field.
func TestImportImageOnNamedNode(t *testing.T) {
	a, b := &importNode{bytes: 10}, &importNode{bytes: 20}
	_, h := newTestRouter(t,
		Member{Name: "n0", Index: 0, Addr: serveFake(t, a), Ready: true},
		Member{Name: "n1", Index: 1, Addr: serveFake(t, b), Ready: true},
	)
	msgs, err := runImport(t, h, &hypervisorv1.ImportImageRequest{Source: "r/python:3.12", Id: "python", Node: "n1"})
	if err != nil || len(msgs) != 3 {
		t.Fatalf("import on n1: %v %v", err, msgs)
	}
	if msgs[1].GetBytesDone() != 20 || msgs[2].GetPhase() != hypervisorv1.ImportPhase_IMPORT_PHASE_DONE || msgs[2].GetImage().GetNode() != "n1" {
		t.Errorf("relayed %v", msgs)
	}
	if len(a.requests()) != 0 {
		t.Errorf("n0 got %v", a.requests())
	}
	if r := b.requests(); len(r) != 1 || !proto.Equal(r[0], &hypervisorv1.ImportImageRequest{Source: "r/python:3.12", Id: "python"}) {
		t.Errorf("n1 got %v", r)
	}
	if _, err := runImport(t, h, &hypervisorv1.ImportImageRequest{Source: "s", Node: "n9"}); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("unknown node: %v, want not_found", err)
	}
}

// Without node, every node imports: one merged stream (phases in order,
// bytes summed), then one DONE, the lowest-index node's image, unchanged
// only when it was everywhere.
func TestImportImageEverywhere(t *testing.T) {
	a, b := &importNode{bytes: 10, unchanged: true}, &importNode{bytes: 20}
	_, h := newTestRouter(t,
		Member{Name: "n0", Index: 0, Addr: serveFake(t, a), Ready: true},
		Member{Name: "n1", Index: 1, Addr: serveFake(t, b), Ready: true},
	)
	msgs, err := runImport(t, h, &hypervisorv1.ImportImageRequest{Source: "r/python:3.12", Id: "python"})
	if err != nil || len(msgs) < 2 {
		t.Fatalf("fleet import: %v %v", err, msgs)
	}
	last := msgs[len(msgs)-1]
	if last.GetPhase() != hypervisorv1.ImportPhase_IMPORT_PHASE_DONE || last.GetImage().GetNode() != "n0" || last.GetUnchanged() {
		t.Errorf("last message %v, want DONE with n0's image, not unchanged", last)
	}
	var phase hypervisorv1.ImportPhase
	var sawBoth bool
	for _, m := range msgs[:len(msgs)-1] {
		if m.GetPhase() < phase || m.GetPhase() == hypervisorv1.ImportPhase_IMPORT_PHASE_DONE {
			t.Errorf("merged phases go %s then %s", phase, m.GetPhase())
		}
		phase = m.GetPhase()
		sawBoth = sawBoth || m.GetBytesTotal() == 30
	}
	if !sawBoth {
		t.Errorf("no merged message sums both nodes' bytes: %v", msgs)
	}
	for _, n := range []*importNode{a, b} {
		if len(n.requests()) != 1 {
			t.Errorf("a node got %d imports", len(n.requests()))
		}
	}

	// Unchanged everywhere: unchanged.
	b.unchanged = true
	msgs, err = runImport(t, h, &hypervisorv1.ImportImageRequest{Source: "r/python:3.12", Id: "python"})
	if err != nil || !msgs[len(msgs)-1].GetUnchanged() {
		t.Errorf("import everywhere unchanged: %v %v", err, msgs)
	}
}

// A node that fails fails the fleet-wide import, named, with its code;
// what the others imported stays.
func TestImportImageFailsOnANode(t *testing.T) {
	a := &importNode{bytes: 10}
	b := &importNode{bytes: 10, fail: apierr.Errorf(apierr.ResourceExhausted, "over the image store quota")}
	_, h := newTestRouter(t,
		Member{Name: "n0", Index: 0, Addr: serveFake(t, a), Ready: true},
		Member{Name: "n1", Index: 1, Addr: serveFake(t, b), Ready: true},
	)
	msgs, err := runImport(t, h, &hypervisorv1.ImportImageRequest{Source: "s", Id: "s"})
	if apierr.CodeOf(err) != apierr.ResourceExhausted || !strings.Contains(apierr.MessageOf(err), "failed on 1 of 2 fleet nodes (the others imported it): n1: over the image store quota") {
		t.Errorf("err %v, want resource_exhausted naming n1", err)
	}
	for _, m := range msgs {
		if m.GetPhase() == hypervisorv1.ImportPhase_IMPORT_PHASE_DONE {
			t.Errorf("a DONE after a node failed: %v", m)
		}
	}
}

// Cancelling the fleet's call cancels the nodes' imports.
func TestImportImageCancelReachesTheNodes(t *testing.T) {
	for _, node := range []string{"n0", ""} {
		a := &importNode{block: true, ended: make(chan struct{})}
		_, h := newTestRouter(t, Member{Name: "n0", Index: 0, Addr: serveFake(t, a), Ready: true})
		ctx, cancel := context.WithCancel(context.Background())
		sink := &importSink{ctx: ctx, msgs: make(chan *hypervisorv1.ImportImageResponse, 64)}
		done := make(chan error, 1)
		go func() { done <- h.ImportImage(&hypervisorv1.ImportImageRequest{Source: "s", Node: node}, sink) }()
		select {
		case <-sink.msgs:
		case <-time.After(poll.Bound):
			t.Fatalf("node %q: no progress", node)
		}
		cancel()
		select {
		case <-a.ended:
		case <-time.After(poll.Bound):
			t.Fatalf("node %q: the node's import was not cancelled", node)
		}
		select {
		case err := <-done:
			if err == nil {
				t.Errorf("node %q: a cancelled import ended without error", node)
			}
		case <-time.After(poll.Bound):
			t.Fatalf("node %q: the fleet's call did not end", node)
		}
	}
}
