package lifecycle

import (
	"errors"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// The contract's transitions (§3.2) are legal; a few that are not.
func TestTransitions(t *testing.T) {
	live := []state{installing, booting, attesting, ready, running, stopping}
	legal := [][2]state{
		{creating, installing}, {creating, booting}, {installing, booting}, {installing, failed}, {installing, stopped},
		{booting, attesting}, {booting, ready}, {attesting, ready}, {booting, running}, {attesting, running}, {running, ready},
		{stopping, stopped}, {stopped, booting}, {failed, booting},
		{creating, failed}, {deleting, failed}, // a restart caught them
		{ready, booting}, {running, booting}, // a reset inside the guest
	}
	for _, s := range live {
		legal = append(legal, [2]state{s, deleting}, [2]state{s, failed}, [2]state{s, stopped})
		if s != stopping {
			legal = append(legal, [2]state{s, stopping})
		}
	}
	for _, s := range []state{stopped, failed} {
		legal = append(legal, [2]state{s, deleting}, [2]state{s, s})
	}
	for _, c := range legal {
		if err := Check(c[0], c[1]); err != nil {
			t.Errorf("%v", err)
		}
	}
	for _, c := range [][2]state{
		{stopped, ready}, {stopped, stopping}, {deleting, booting}, {creating, ready}, {failed, ready}, {stopping, ready},
		{deleting, stopped}, {hypervisorv1.State_STATE_UNSPECIFIED, ready},
	} {
		if Allowed(c[0], c[1]) {
			t.Errorf("%s → %s is allowed", Name(c[0]), Name(c[1]))
		}
	}
	if err := Check(stopped, ready); err == nil || err.Error() != "illegal state change stopped → ready" {
		t.Errorf("Check: %v", err)
	}
}

type memRevision struct {
	rev    uint64
	writes int
}

func (m *memRevision) WatchRevision() (uint64, error) { return m.rev, nil }
func (m *memRevision) SetWatchRevision(r uint64) error {
	m.rev = r
	m.writes++
	return nil
}

func TestBroker(t *testing.T) {
	b, _ := NewBroker(3, nil)
	early, err := b.Subscribe(0, 8)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		if r := b.Publish(Event{VMID: "v", To: hypervisorv1.State(i)}); r != uint64(i+1) {
			t.Fatalf("revision %d", r)
		}
	}
	for i := range 5 {
		if e := <-early.C(); e.Revision != uint64(i+1) {
			t.Fatalf("event %d: revision %d", i, e.Revision)
		}
	}
	early.Cancel()
	if _, open := <-early.C(); open {
		t.Error("cancel left the channel open")
	}
	// Resuming after revision 3 gets 4 and 5 from the retained ones; after
	// 2 it gets 3, the oldest retained.
	late, err := b.Subscribe(3, 1)
	if err != nil || (<-late.C()).Revision != 4 || (<-late.C()).Revision != 5 {
		t.Errorf("resume from 3: %v", err)
	}
	if s, err := b.Subscribe(2, 1); err != nil || (<-s.C()).Revision != 3 {
		t.Errorf("resume from 2: %v", err)
	}
	// Revision 1 is no longer retained (3 are), 9 was never handed out.
	for _, since := range []uint64{1, 9} {
		if _, err := b.Subscribe(since, 1); !errors.Is(err, ErrRevisionGone) {
			t.Errorf("resume from %d: %v", since, err)
		}
	}
	// A full subscriber is cut off (closed, Lagged, counted) on the event
	// it cannot take; the publisher never blocks.
	for range 4 { // late's channel holds 3 (its buffer and the backlog's room, read)
		b.Publish(Event{VMID: "w"})
	}
	if b.Cut() < 1 || !late.Lagged() {
		t.Errorf("cut %d, lagged %v", b.Cut(), late.Lagged())
	}
	n := 0
	for range late.C() {
		n++
	}
	if n != 3 {
		t.Errorf("a lagged subscriber got %d events before its channel closed, want 3", n)
	}
}

// A snapshot holds every existing VM's last record, at one revision, and the
// subscription continues right after it; a deletion removes the VM.
func TestBrokerSnapshot(t *testing.T) {
	b, _ := NewBroker(0, nil)
	b.Seed(&storepb.VirtualMachine{Id: "a", State: hypervisorv1.State_STATE_STOPPED})
	b.Publish(Event{VMID: "b", To: hypervisorv1.State_STATE_CREATING, Record: &storepb.VirtualMachine{Id: "b"}})
	b.Publish(Event{VMID: "c", To: hypervisorv1.State_STATE_CREATING, Record: &storepb.VirtualMachine{Id: "c"}})
	b.Publish(Event{VMID: "c", Deleted: true})
	sub, cur, rev := b.Snapshot(4)
	if rev != 3 || len(cur) != 2 || cur[0].VMID != "a" || cur[1].VMID != "b" {
		t.Fatalf("snapshot at %d: %+v", rev, cur)
	}
	b.Publish(Event{VMID: "b", Deleted: true})
	if e := <-sub.C(); e.Revision != 4 || !e.Deleted || e.Record.GetId() != "b" {
		t.Errorf("after the snapshot: %+v", e)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if _, open := <-sub.C(); open {
		t.Error("Close left a subscription open")
	}
}

// Revisions continue across restarts: exactly after a clean Close (a
// subscriber that saw the last one resumes), above the reserved ceiling
// after a crash (older revisions refused, none reused).
func TestBrokerRevisionsSurviveRestarts(t *testing.T) {
	st := &memRevision{}
	b, _ := NewBroker(0, st)
	for range 3 {
		b.Publish(Event{VMID: "v"})
	}
	if st.writes != 1 || st.rev != 1+reserveBlock {
		t.Fatalf("ceiling %d after %d writes", st.rev, st.writes)
	}
	_ = b.Close()
	b2, _ := NewBroker(0, st) // clean restart
	if r := b2.Publish(Event{VMID: "v"}); r != 4 {
		t.Errorf("after a clean restart: revision %d, want 4", r)
	}
	if s, err := b2.Subscribe(3, 1); err != nil || (<-s.C()).Revision != 4 {
		t.Errorf("resume from the last revision before the restart: %v", err)
	}
	if _, err := b2.Subscribe(2, 1); !errors.Is(err, ErrRevisionGone) {
		t.Errorf("resume from before the restart's last revision: %v", err)
	}
	b3, _ := NewBroker(0, st) // b2 crashed: no Close
	if r := b3.Publish(Event{VMID: "v"}); r <= 4+reserveBlock-1 {
		t.Errorf("after a crash: revision %d reuses one b2 may have handed out", r)
	}
	if _, err := b3.Subscribe(4, 1); !errors.Is(err, ErrRevisionGone) {
		t.Errorf("resume across a crash: %v", err)
	}
}

// Suspend: only an up guest suspends (and a pool member waiting for its
// user-data, attesting); a suspended VM resumes to where it was, is stopped
// (state discarded) or deleted; nothing boots it directly.
func TestSuspendTransitions(t *testing.T) {
	for _, c := range [][2]state{
		{ready, suspending}, {running, suspending}, {suspending, suspended}, {suspending, ready}, {suspending, running},
		{suspending, failed}, {suspending, stopped}, {suspended, ready}, {suspended, running}, {suspended, stopped}, {suspended, deleting},
		{attesting, suspending}, {suspending, attesting}, {suspended, attesting},
	} {
		if err := Check(c[0], c[1]); err != nil {
			t.Errorf("%v", err)
		}
	}
	for _, c := range [][2]state{
		{booting, suspending}, {installing, suspending}, {stopped, suspending}, {stopped, suspended},
		{suspended, booting}, {suspended, failed}, {suspending, deleting}, {ready, suspended},
	} {
		if Allowed(c[0], c[1]) {
			t.Errorf("%s → %s is allowed", Name(c[0]), Name(c[1]))
		}
	}
}
