package tests

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/sdk/enumname"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// watchEvent is one watch message as a test compares them.
type watchEvent struct {
	Type     string
	Revision uint64
	VM       string
	State    string
}

// grpcWatcher collects a gRPC watch's messages through the gateway.
type grpcWatcher struct {
	mu     sync.Mutex
	events []watchEvent
	end    error
	done   chan struct{}
}

func watchGRPC(t *testing.T, hv hypervisorv1.HypervisorServiceClient, req *hypervisorv1.WatchVirtualMachinesRequest) *grpcWatcher {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	stream, err := hv.WatchVirtualMachines(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	w := &grpcWatcher{done: make(chan struct{})}
	go func() {
		defer close(w.done)
		for {
			m, err := stream.Recv()
			w.mu.Lock()
			if err != nil {
				w.end = err
				w.mu.Unlock()
				return
			}
			w.events = append(w.events, watchEvent{enumname.Of(m.GetType()), m.GetRevision(), m.GetVm().GetId(), enumname.Of(m.GetVm().GetState())})
			w.mu.Unlock()
		}
	}()
	return w
}

func (w *grpcWatcher) seen() []watchEvent {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.events)
}

// until waits for an event satisfying ok.
func (w *grpcWatcher) until(t *testing.T, d time.Duration, what string, ok func(watchEvent) bool) {
	t.Helper()
	cluster.Eventually(t, d, what, func() error {
		if slices.ContainsFunc(w.seen(), ok) {
			return nil
		}
		w.mu.Lock()
		defer w.mu.Unlock()
		return fmt.Errorf("not yet (stream end: %v); %d events", w.end, len(w.events))
	})
}

// sseWatcher reads the REST watch as Server-Sent Events with plain net/http,
// the way a browser's EventSource does (Last-Event-ID on a reconnect).
type sseWatcher struct {
	mu     sync.Mutex
	events []watchEvent
	lastID string
	errors []string
	done   chan struct{}
}

func watchSSE(t *testing.T, url, lastEventID string) *sseWatcher {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
	req.Header.Set("Accept", "text/event-stream")
	if lastEventID != "" {
		req.Header.Set("Last-Event-ID", lastEventID)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("SSE watch: %d %s: %s", resp.StatusCode, resp.Header.Get("Content-Type"), b)
	}
	w := &sseWatcher{done: make(chan struct{}), lastID: lastEventID}
	go func() {
		defer close(w.done)
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		var id, event, data string
		for sc.Scan() {
			line := sc.Text()
			switch {
			case strings.HasPrefix(line, "id: "):
				id = strings.TrimPrefix(line, "id: ")
			case strings.HasPrefix(line, "event: "):
				event = strings.TrimPrefix(line, "event: ")
			case strings.HasPrefix(line, "data: "):
				data = strings.TrimPrefix(line, "data: ")
			case line == "":
				var m struct {
					Type     string
					Revision uint64
					VM       struct{ ID, State string } `json:"vm"`
				}
				w.mu.Lock()
				if event == "error" {
					w.errors = append(w.errors, data)
				} else if err := json.Unmarshal([]byte(data), &m); err != nil || m.Type != event || (id != "" && id != strconv.FormatUint(m.Revision, 10)) {
					w.errors = append(w.errors, fmt.Sprintf("bad event id=%q event=%q data=%s: %v", id, event, data, err))
				} else {
					w.events = append(w.events, watchEvent{m.Type, m.Revision, m.VM.ID, m.VM.State})
					if id != "" {
						w.lastID = id
					}
				}
				w.mu.Unlock()
				id, event, data = "", "", ""
			}
		}
	}()
	return w
}

func (w *sseWatcher) seen() ([]watchEvent, string, []string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.events), w.lastID, slices.Clone(w.errors)
}

// logTransitions are the "vm state" lines of the hypervisor's JSON log for one
// VM: its transition log, "to" of each.
func logTransitions(t *testing.T, logFile, id string) []string {
	t.Helper()
	b, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for line := range strings.SplitSeq(string(b), "\n") {
		var l struct{ Msg, VM, To string }
		if json.Unmarshal([]byte(line), &l) == nil && l.Msg == "vm state" && l.VM == id {
			out = append(out, l.To)
		}
	}
	return out
}

// states is the sequence of states the events of one VM show, each change
// once (a record change within a state is an event too), ending in
// "deleted" for its deletion.
func states(events []watchEvent, id string) []string {
	var out []string
	for _, e := range events {
		if e.VM != id || e.Type == "snapshot" {
			continue
		}
		s := e.State
		if e.Type == "deleted" {
			s = "deleted"
		}
		if len(out) == 0 || out[len(out)-1] != s {
			out = append(out, s)
		}
	}
	return out
}

// TestWatch follows a real guest's create, stop and delete through the
// gateway as the three binaries: over gRPC (the SDK), grpcurl, REST's
// newline-delimited JSON and Server-Sent Events from a plain HTTP client.
// Each shows the hypervisor's transition log for the VM, in order, with
// increasing revisions; a watch resumed after a gateway restart, and after
// a hypervisor restart, from the last revision it saw misses nothing; a
// revision older than the retained window is refused with out_of_range.
func TestWatch(t *testing.T) {
	images := cluster.GuestImages(t, "..")
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, Quiet: true,
		Env: []string{"VM_MANAGER_LOG_FORMAT=json"}})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })
	dial := func(target string) hypervisorv1.HypervisorServiceClient {
		conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return hypervisorv1.NewHypervisorServiceClient(conn)
	}
	gw := dial(c.Addr)
	isSynced := func(e watchEvent) bool { return e.Type == "synced" }

	all := watchGRPC(t, gw, &hypervisorv1.WatchVirtualMachinesRequest{})
	all.until(t, 30*time.Second, "gRPC watch synced", isSynced)
	sse := watchSSE(t, a.base+"/vms:watch?name=w1", "")

	// grpcurl, as an operator runs it, prints the states while the create
	// still blocks.
	grpcurl := requireGrpcurl(t)
	gctx, gcancel := context.WithCancel(context.Background())
	defer gcancel()
	gcmd := exec.CommandContext(gctx, grpcurl, "-plaintext", "-d", `{"name":"w1"}`, c.Addr, "vmmanager.hypervisor.v1.HypervisorService/WatchVirtualMachines")
	gout, _ := gcmd.StdoutPipe()
	if err := gcmd.Start(); err != nil {
		t.Fatal(err)
	}
	var gmu sync.Mutex
	var glines []string
	go func() {
		sc := bufio.NewScanner(gout)
		for sc.Scan() {
			gmu.Lock()
			glines = append(glines, sc.Text())
			gmu.Unlock()
		}
	}()
	grpcurlSaw := func(s string) bool {
		gmu.Lock()
		defer gmu.Unlock()
		return slices.ContainsFunc(glines, func(l string) bool { return strings.Contains(l, s) })
	}
	cluster.Eventually(t, 30*time.Second, "grpcurl's watch synced", func() error {
		if grpcurlSaw("WATCH_EVENT_TYPE_SYNCED") {
			return nil
		}
		return fmt.Errorf("no SYNCED yet")
	})

	type result struct {
		code int
		body []byte
		err  error
	}
	created := make(chan result, 1)
	go func() {
		resp, err := http.Post(a.base+"/vms", "application/json", strings.NewReader(`{"name":"w1","image":"test-guest","require_attestation":false,"memory_mib":512,"cpus":1}`))
		if err != nil {
			created <- result{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		created <- result{resp.StatusCode, b, err}
	}()
	var v vmJSON
	live := false
	for done := false; !done; {
		select {
		case r := <-created:
			if r.err != nil || r.code != 201 || json.Unmarshal(r.body, &v) != nil {
				t.Fatalf("create: %d %v %s", r.code, r.err, r.body)
			}
			done = true
		case <-time.After(100 * time.Millisecond):
			live = live || grpcurlSaw("STATE_BOOTING")
		}
	}
	if !live {
		t.Error("grpcurl did not show booting before the create returned")
	}
	if v.State != "ready" {
		t.Fatalf("created %+v", v)
	}
	all.until(t, 30*time.Second, "ready on the gRPC watch", func(e watchEvent) bool { return e.VM == v.ID && e.State == "ready" })
	// grpcurl's stream is another connection: it ends at the gateway's
	// restart below, so wait for it to have printed the ready event first.
	cluster.Eventually(t, 30*time.Second, "ready on grpcurl's watch", func() error {
		if grpcurlSaw("STATE_READY") {
			return nil
		}
		return fmt.Errorf("not yet")
	})

	// A gateway restart: the stream ends (unavailable), the VM stops while
	// no gateway runs, and the watch resumed from its last revision shows
	// the stop.
	if code := c.StopServiceGracefully("gateway", time.Minute); code != 0 {
		t.Errorf("gateway exit %d", code)
	}
	<-all.done
	if status.Code(all.end) != codes.Unavailable {
		t.Errorf("the watch at the gateway's stop ended with %v", all.end)
	}
	<-sse.done
	before := all.seen()
	last := before[len(before)-1].Revision
	_, sseLast, _ := sse.seen()
	hvDirect := dial("unix://" + c.Socket("hypervisor"))
	if _, err := hvDirect.StopVirtualMachine(context.Background(), &hypervisorv1.StopVirtualMachineRequest{Id: v.ID}); err != nil {
		t.Fatal(err)
	}
	c.StartService("gateway")
	c.WaitReady(30 * time.Second)
	resumed := watchGRPC(t, gw, &hypervisorv1.WatchVirtualMachinesRequest{SinceRevision: last})
	resumed.until(t, 30*time.Second, "stopped after the gateway restart", func(e watchEvent) bool { return e.VM == v.ID && e.State == "stopped" })
	sse2 := watchSSE(t, a.base+"/vms:watch?name=w1", sseLast)

	// A hypervisor restart (graceful: its VMs stay as they are) keeps the
	// revisions: the resume from the last one goes on.
	resumed.until(t, 30*time.Second, "synced", isSynced)
	if code := c.StopServiceGracefully("hypervisor", time.Minute); code != 0 {
		t.Errorf("hypervisor exit %d", code)
	}
	<-resumed.done
	mid := resumed.seen()
	c.StartService("hypervisor")
	c.WaitReady(30 * time.Second)
	<-sse2.done // the hypervisor ended it too
	_, sseLast2, _ := sse2.seen()
	final := watchGRPC(t, gw, &hypervisorv1.WatchVirtualMachinesRequest{SinceRevision: mid[len(mid)-1].Revision})
	final.until(t, 30*time.Second, "synced after the hypervisor restart", isSynced)
	sse3 := watchSSE(t, a.base+"/vms:watch?name=w1", sseLast2)
	a.vm("DELETE", "/vms/"+v.ID, "", 204)
	final.until(t, 30*time.Second, "deleted", func(e watchEvent) bool { return e.VM == v.ID && e.Type == "deleted" })
	cluster.Eventually(t, 30*time.Second, "SSE deleted", func() error {
		if ev, _, _ := sse3.seen(); slices.ContainsFunc(ev, func(e watchEvent) bool { return e.Type == "deleted" }) {
			return nil
		}
		return fmt.Errorf("not yet")
	})

	// What the hypervisor logged, in order, is what every watch showed:
	// creating (the record's first event, not logged as a change), the
	// log's changes, deleted.
	want := append(append([]string{"creating"}, logTransitions(t, c.Dir+"/hypervisor.log", v.ID)...), "deleted")
	t.Logf("vm %s: creating, the hypervisor's transition log, deleted: %v", v.ID, want)
	var grpcEvents []watchEvent
	for _, w := range []*grpcWatcher{all, resumed, final} {
		grpcEvents = append(grpcEvents, w.seen()...)
	}
	if got := states(grpcEvents, v.ID); !slices.Equal(got, want) {
		t.Errorf("gRPC watch (across both restarts): %v\nhypervisor's log: %v", got, want)
	}
	var prev uint64
	for _, e := range grpcEvents {
		if e.Type == "changed" || e.Type == "deleted" {
			if e.Revision <= prev {
				t.Errorf("revision %d after %d", e.Revision, prev)
			}
			prev = e.Revision
		}
	}
	var sseEvents []watchEvent
	for _, w := range []*sseWatcher{sse, sse2, sse3} {
		ev, _, errs := w.seen()
		sseEvents = append(sseEvents, ev...)
		for _, e := range errs {
			if !strings.Contains(e, `"unavailable"`) { // the restarts end a stream so
				t.Errorf("SSE error event: %s", e)
			}
		}
	}
	if got := states(sseEvents, v.ID); !slices.Equal(got, want) {
		t.Errorf("SSE watch (Last-Event-ID across both restarts): %v\nhypervisor's log: %v", got, want)
	}
	gcancel()
	_ = gcmd.Wait()
	for _, s := range []string{"STATE_CREATING", "STATE_BOOTING", "STATE_READY", "\"revision\""} {
		if !grpcurlSaw(s) {
			t.Errorf("grpcurl's watch lacks %s", s)
		}
	}

	// REST as newline-delimited JSON: one {"result":…} per line.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", a.base+"/vms:watch", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	line, _ := bufio.NewReader(resp.Body).ReadString('\n')
	resp.Body.Close()
	var first struct{ Result struct{ Type string } }
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/x-ndjson" || json.Unmarshal([]byte(line), &first) != nil || first.Result.Type != "synced" {
		t.Errorf("NDJSON watch: %d %s %q", resp.StatusCode, resp.Header.Get("Content-Type"), line)
	}

	// The window starts after the hypervisor's restart: revision 1 is
	// refused, on every surface (the window of --watch-retain events:
	// services/hypervisor/internal/vm TestWatchRefusals).
	_, err = func() (*hypervisorv1.WatchVirtualMachinesResponse, error) {
		s, err := gw.WatchVirtualMachines(ctx, &hypervisorv1.WatchVirtualMachinesRequest{SinceRevision: 1})
		if err != nil {
			return nil, err
		}
		return s.Recv()
	}()
	if status.Code(err) != codes.OutOfRange || apierr.CodeOf(err) != apierr.OutOfRange || !strings.Contains(apierr.MessageOf(err), "list the VMs again") {
		t.Errorf("gRPC resume from revision 1: %v", err)
	}
	for _, h := range []http.Header{{}, {"Accept": {"text/event-stream"}}} {
		code, _, body := cluster.DoContext(ctx, t, "GET", a.base+"/vms:watch?since_revision=1", "", h)
		if code != http.StatusGone || !strings.Contains(string(body), `"code": "out_of_range"`) {
			t.Errorf("REST resume from revision 1 (%v): %d %s", h, code, body)
		}
	}
	code, _, body := cluster.DoContext(ctx, t, "GET", a.base+"/vms:watch?since_revision=x&id=1", "", nil)
	if code != http.StatusBadRequest || !strings.Contains(string(body), "invalid_request") {
		t.Errorf("REST watch with a bad revision: %d %s", code, body)
	}
}
