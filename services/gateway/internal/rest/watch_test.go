package rest

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
)

// fakeWatch answers WatchVirtualMachines with canned messages, then err.
type fakeWatch struct {
	hypervisorv1.HypervisorServiceClient
	msgs []*hypervisorv1.WatchVirtualMachinesResponse
	err  error
	req  *hypervisorv1.WatchVirtualMachinesRequest
	wait <-chan struct{} // before err, if set
}

func (f *fakeWatch) WatchVirtualMachines(ctx context.Context, req *hypervisorv1.WatchVirtualMachinesRequest, _ ...grpc.CallOption) (grpc.ServerStreamingClient[hypervisorv1.WatchVirtualMachinesResponse], error) {
	f.req = req
	return &fakeStream{ctx: ctx, f: f}, nil
}

type fakeStream struct {
	grpc.ClientStream
	ctx context.Context
	f   *fakeWatch
	n   int
}

func (s *fakeStream) Recv() (*hypervisorv1.WatchVirtualMachinesResponse, error) {
	if s.n < len(s.f.msgs) {
		s.n++
		return s.f.msgs[s.n-1], nil
	}
	if s.f.wait != nil {
		select {
		case <-s.f.wait:
		case <-s.ctx.Done():
			return nil, s.ctx.Err()
		}
	}
	return nil, s.f.err
}

var watchMsgs = []*hypervisorv1.WatchVirtualMachinesResponse{
	{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SNAPSHOT, Revision: 7, Vm: &hypervisorv1.VirtualMachine{Id: "0a0b0c0d", Name: "web", State: hypervisorv1.State_STATE_READY}},
	{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED, Revision: 7},
	{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_CHANGED, Revision: 9, Vm: &hypervisorv1.VirtualMachine{Id: "0a0b0c0d", Name: "web", State: hypervisorv1.State_STATE_STOPPING}, PreviousState: hypervisorv1.State_STATE_READY},
}

func serveWatch(t *testing.T, f *fakeWatch, drain context.Context, target string, h http.Header) *httptest.ResponseRecorder {
	t.Helper()
	r := httptest.NewRequest("GET", target, nil)
	for k, v := range h {
		r.Header[k] = v
	}
	w := httptest.NewRecorder()
	Watch(f, drain, slog.New(slog.DiscardHandler)).ServeHTTP(w, r)
	return w
}

// A line per message, {"result":…}, and a failure after the start as a last
// {"error":…} line.
func TestWatchNDJSON(t *testing.T) {
	f := &fakeWatch{msgs: watchMsgs, err: apierr.Errorf(apierr.ResourceExhausted, "cut off; watch again with since_revision 9")}
	w := serveWatch(t, f, context.Background(), "/api/v1/vms:watch?name=web&since_revision=3", nil)
	if f.req.GetName() != "web" || f.req.GetSinceRevision() != 3 {
		t.Errorf("request %v", f.req)
	}
	lines := strings.Split(strings.TrimSuffix(w.Body.String(), "\n"), "\n")
	if w.Code != 200 || w.Header().Get("Content-Type") != "application/x-ndjson" || len(lines) != 4 {
		t.Fatalf("%d %s:\n%s", w.Code, w.Header().Get("Content-Type"), w.Body)
	}
	if !strings.HasPrefix(lines[2], `{"result":{"type":"changed","revision":9,"vm":{`) || !strings.HasSuffix(lines[2], `,"previousState":"ready"}}`) {
		t.Errorf("change line %s", lines[2])
	}
	if lines[3] != `{"error":{"code":"resource_exhausted","message":"cut off; watch again with since_revision 9"}}` {
		t.Errorf("error line %s", lines[3])
	}
}

// Server-Sent Events: id on all but snapshots, Last-Event-ID resumes, a
// drain ends the stream with unavailable naming the revision to resume from.
func TestWatchSSE(t *testing.T) {
	drain, end := context.WithCancel(context.Background())
	wait := make(chan struct{})
	f := &fakeWatch{msgs: watchMsgs, err: context.Canceled, wait: wait}
	go func() {
		end() // the gateway shuts down once the messages are out
		close(wait)
	}()
	w := serveWatch(t, f, drain, "/api/v1/vms:watch", http.Header{"Accept": {"text/html, text/event-stream;q=0.9"}, "Last-Event-Id": {"5"}})
	if f.req.GetSinceRevision() != 5 {
		t.Errorf("Last-Event-ID not taken: %v", f.req)
	}
	body := w.Body.String()
	if w.Code != 200 || w.Header().Get("Content-Type") != "text/event-stream" {
		t.Fatalf("%d %s", w.Code, w.Header().Get("Content-Type"))
	}
	events := strings.Split(strings.TrimSuffix(body, "\n\n"), "\n\n")
	if len(events) != 4 || !strings.HasPrefix(events[0], "event: snapshot\ndata: {") || !strings.HasPrefix(events[1], "id: 7\nevent: synced\ndata: {") ||
		!strings.HasPrefix(events[2], "id: 9\nevent: changed\ndata: {") {
		t.Fatalf("events:\n%s", body)
	}
	if events[3] != `event: error`+"\n"+`data: {"error":{"code":"unavailable","message":"the gateway is shutting down; watch again with since_revision 9"}}` {
		t.Errorf("last event %q", events[3])
	}
}

// Bad queries and errors before the first message are the usual envelope.
func TestWatchRefusals(t *testing.T) {
	for _, c := range []struct {
		target string
		code   int
	}{
		{"/api/v1/vms:watch?since_revision=-1", 400},
		{"/api/v1/vms:watch?since_revision=1&since_revision=2", 400},
		{"/api/v1/vms:watch?nope=1", 400},
	} {
		w := serveWatch(t, &fakeWatch{}, context.Background(), c.target, nil)
		if w.Code != c.code || !strings.Contains(w.Body.String(), `"code": "invalid_request"`) {
			t.Errorf("%s: %d %s", c.target, w.Code, w.Body)
		}
	}
	f := &fakeWatch{err: apierr.Errorf(apierr.OutOfRange, "too old")}
	w := serveWatch(t, f, context.Background(), "/api/v1/vms:watch?since_revision=1", http.Header{"Accept": {"text/event-stream"}})
	if b, _ := io.ReadAll(w.Body); w.Code != http.StatusGone || !strings.Contains(string(b), `"code": "out_of_range"`) {
		t.Errorf("out of range: %d %s", w.Code, b)
	}
}

// HEAD answers the stream's headers and returns.
func TestWatchHead(t *testing.T) {
	r := httptest.NewRequest("HEAD", "/api/v1/vms:watch", nil)
	w := httptest.NewRecorder()
	Watch(&fakeWatch{}, context.Background(), slog.New(slog.DiscardHandler)).ServeHTTP(w, r)
	if w.Code != 200 || w.Header().Get("Content-Type") != "application/x-ndjson" || w.Body.Len() != 0 {
		t.Errorf("HEAD: %d %s %q", w.Code, w.Header().Get("Content-Type"), w.Body)
	}
}
