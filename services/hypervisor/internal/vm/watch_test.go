package vm

import (
	"context"
	"slices"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

type watchMsg = hypervisorv1.WatchVirtualMachinesResponse

// watch runs Manager.Watch in the background; its messages arrive on msgs,
// its end on done.
func (h *harness) watch(req *hypervisorv1.WatchVirtualMachinesRequest) (msgs <-chan *watchMsg, done <-chan error, cancel func()) {
	ctx, cancel := context.WithCancel(context.Background())
	out := make(chan *watchMsg, 256)
	end := make(chan error, 1)
	go func() {
		end <- h.m.Watch(ctx, req, func(m *watchMsg) error { out <- m; return nil })
	}()
	h.t.Cleanup(cancel)
	return out, end, cancel
}

// next returns the next message, failing after 5 s.
func next(t *testing.T, msgs <-chan *watchMsg) *watchMsg {
	t.Helper()
	select {
	case m := <-msgs:
		return m
	case <-time.After(5 * time.Second):
		t.Fatal("no watch message within 5 s")
		return nil
	}
}

// A watch starts with a snapshot (the filter's VMs, then SYNCED at the same
// revision), then every change of a create, a stop and a delete, in the
// order the lifecycle made them, with increasing revisions; a resume from
// a revision replays exactly what followed it.
func TestWatch(t *testing.T) {
	h := newHarness(t)
	old := h.create("old")
	all, _, _ := h.watch(&hypervisorv1.WatchVirtualMachinesRequest{})
	m := next(t, all)
	if m.GetType() != hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SNAPSHOT || m.GetVm().GetId() != old.GetId() || m.GetVm().GetState() != hypervisorv1.State_STATE_READY {
		t.Fatalf("snapshot: %v", m)
	}
	start := m.GetRevision()
	if s := next(t, all); s.GetType() != hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED || s.GetRevision() != start || s.GetVm() != nil {
		t.Fatalf("after the snapshot: %v", s)
	}
	byName, _, _ := h.watch(&hypervisorv1.WatchVirtualMachinesRequest{Name: "web"})
	if s := next(t, byName); s.GetType() != hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED {
		t.Fatalf("a name no VM has: %v", s)
	}

	v := h.create("web")
	if _, err := h.m.Stop(context.Background(), v.GetId()); err != nil {
		t.Fatal(err)
	}
	if err := h.m.Delete(context.Background(), v.GetId()); err != nil {
		t.Fatal(err)
	}
	// The sequence the watch shows is the state log of the VM: every
	// change, deletions included.
	var states []hypervisorv1.State
	var revs []uint64
	last := start
	for {
		m := next(t, all)
		if m.GetRevision() <= last {
			t.Fatalf("revision %d after %d", m.GetRevision(), last)
		}
		last = m.GetRevision()
		if m.GetVm().GetId() != v.GetId() {
			continue // old's own changes (its boot settling)
		}
		revs = append(revs, m.GetRevision())
		if len(states) == 0 || states[len(states)-1] != m.GetVm().GetState() {
			states = append(states, m.GetVm().GetState())
		}
		if m.GetType() == hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_DELETED {
			break
		}
		if m.GetType() != hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_CHANGED {
			t.Fatalf("type %v", m)
		}
	}
	want := []hypervisorv1.State{hypervisorv1.State_STATE_CREATING, hypervisorv1.State_STATE_BOOTING, hypervisorv1.State_STATE_READY,
		hypervisorv1.State_STATE_STOPPING, hypervisorv1.State_STATE_STOPPED, hypervisorv1.State_STATE_DELETING}
	if !slices.Equal(states, want) {
		t.Errorf("states %v, want %v", states, want)
	}
	// The name filter saw the same events (of web only).
	for _, r := range revs {
		if m := next(t, byName); m.GetRevision() != r {
			t.Fatalf("name filter: revision %d, want %d", m.GetRevision(), r)
		}
	}

	// A resume from the middle replays the rest, then SYNCED.
	resumed, _, _ := h.watch(&hypervisorv1.WatchVirtualMachinesRequest{SinceRevision: revs[2], Name: "web"})
	for _, r := range revs[3:] {
		if m := next(t, resumed); m.GetRevision() != r || m.GetType() == hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SNAPSHOT {
			t.Fatalf("resume: %v, want revision %d", m, r)
		}
	}
	if s := next(t, resumed); s.GetType() != hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED || s.GetRevision() < last {
		t.Errorf("resume ends with %v", s)
	}
}

// Bad filters and revisions are refused with their codes; an id filter
// names a VM that exists.
func TestWatchRefusals(t *testing.T) {
	h := newHarness(t)
	h.tweak = func(c *Config) { c.Watch.Retain = 2 }
	h.m.Close()
	h.start()
	v := h.create("web") // more than 2 events
	for _, c := range []struct {
		req  *hypervisorv1.WatchVirtualMachinesRequest
		code apierr.Code
	}{
		{&hypervisorv1.WatchVirtualMachinesRequest{Id: "../x"}, apierr.InvalidRequest},
		{&hypervisorv1.WatchVirtualMachinesRequest{Name: "Not_A_Label"}, apierr.InvalidRequest},
		{&hypervisorv1.WatchVirtualMachinesRequest{Id: "0f0f0f0f"}, apierr.NotFound},
		{&hypervisorv1.WatchVirtualMachinesRequest{SinceRevision: 1}, apierr.OutOfRange},                // older than the 2 retained
		{&hypervisorv1.WatchVirtualMachinesRequest{SinceRevision: 1 << 40}, apierr.OutOfRange},          // never handed out
		{&hypervisorv1.WatchVirtualMachinesRequest{Id: v.GetId(), SinceRevision: 1}, apierr.OutOfRange}, // filters do not widen the window
	} {
		// A refusal is immediate; a watch that runs ends with the deadline.
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err := h.m.Watch(ctx, c.req, func(*watchMsg) error { return nil })
		cancel()
		if apierr.CodeOf(err) != c.code {
			t.Errorf("%v: %v, want %s", c.req, err, c.code)
		}
	}
}

// A watcher that does not keep up is cut off with resource_exhausted
// (counted), never skipping an event and never blocking the VM; one watcher
// over --max-watchers is refused (counted).
func TestWatchBounds(t *testing.T) {
	h := newHarness(t)
	h.tweak = func(c *Config) { c.Watch.Buffer, c.Watch.MaxWatchers = 2, 2 }
	h.m.Close()
	h.start()
	v := h.create("web")
	stuck := make(chan struct{})
	t.Cleanup(func() { close(stuck) })
	slow := make(chan error, 1)
	got := 0
	go func() {
		slow <- h.m.Watch(context.Background(), &hypervisorv1.WatchVirtualMachinesRequest{}, func(*watchMsg) error {
			if got++; got == 3 { // snapshot, SYNCED, then it stops reading
				<-stuck
			}
			return nil
		})
	}()
	_, _, cancelOther := h.watch(&hypervisorv1.WatchVirtualMachinesRequest{})
	deadline := time.Now().Add(5 * time.Second)
	for open, _, _ := h.m.WatchCounters(); open < 2; open, _, _ = h.m.WatchCounters() {
		if time.Now().After(deadline) {
			t.Fatal("watchers did not start")
		}
		time.Sleep(5 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	err := h.m.Watch(ctx, &hypervisorv1.WatchVirtualMachinesRequest{}, func(*watchMsg) error { return nil })
	cancel()
	if apierr.CodeOf(err) != apierr.ResourceExhausted {
		t.Errorf("a third watcher: %v", err)
	}
	cancelOther()
	for i := range 6 { // the VM's changes go on whatever the watcher does
		if err := h.m.Update(v.GetId(), func(r *storepb.VirtualMachine) { r.Status = string(rune('a' + i)) }); err != nil {
			t.Fatal(err)
		}
	}
	stuck <- struct{}{}
	select {
	case err := <-slow:
		if apierr.CodeOf(err) != apierr.ResourceExhausted {
			t.Errorf("slow watcher: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the slow watcher was not cut off")
	}
	if _, refused, cut := h.m.WatchCounters(); refused != 1 || cut != 1 {
		t.Errorf("refused %d, cut %d", refused, cut)
	}
	if r := h.m.BoundCounters().GetRefusedTotal(); r[LimitWatchers] != 1 || r[LimitWatchBuffer] != 1 {
		t.Errorf("bound counters %v", r)
	}
}

// A restart continues the revisions: a watcher that saw the last one
// before a clean stop resumes and gets the restart's own changes (the VM
// whose process is gone, stopped), missing nothing; EndWatches ends open
// streams with unavailable.
func TestWatchAcrossRestart(t *testing.T) {
	h := newHarness(t)
	v := h.create("web")
	msgs, done, _ := h.watch(&hypervisorv1.WatchVirtualMachinesRequest{})
	var last uint64 // of the last message the watcher got
	// The snapshot first: a Close before it was sent leaves nothing to resume from.
	for m := next(t, msgs); ; m = next(t, msgs) {
		last = m.GetRevision()
		if m.GetType() == hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED {
			break
		}
	}
	h.m.Close()
	select {
	case err := <-done:
		if apierr.CodeOf(err) != apierr.Unavailable {
			t.Errorf("watch at Close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close left the watch open")
	}
	for len(msgs) > 0 {
		last = (<-msgs).GetRevision()
	}
	h.drv.mu.Lock()
	h.drv.gone[v.GetId()] = true
	h.drv.mu.Unlock()
	h.start()
	resumed, _, _ := h.watch(&hypervisorv1.WatchVirtualMachinesRequest{SinceRevision: last})
	m := next(t, resumed)
	if m.GetRevision() != last+1 || m.GetType() != hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_CHANGED || m.GetVm().GetState() != hypervisorv1.State_STATE_STOPPED {
		t.Errorf("after the restart: %v (last before it %d)", m, last)
	}
}
