package lifecycle

import (
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
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

func TestBroker(t *testing.T) {
	b := NewBroker(3)
	early, cancelEarly, _ := b.Subscribe(0, 8)
	for i := range 5 {
		if r := b.Publish(Event{VMID: "v", To: hypervisorv1.State(i)}); r != uint64(i+1) {
			t.Fatalf("revision %d", r)
		}
	}
	for i := range 5 {
		if e := <-early; e.Revision != uint64(i+1) {
			t.Fatalf("event %d: revision %d", i, e.Revision)
		}
	}
	cancelEarly()
	if _, open := <-early; open {
		t.Error("cancel left the channel open")
	}
	// Resuming after revision 3 gets 4 and 5 from the retained ones.
	late, cancel, ok := b.Subscribe(3, 1)
	defer cancel()
	if !ok || (<-late).Revision != 4 || (<-late).Revision != 5 {
		t.Error("resume from 3")
	}
	// Revision 1 is no longer retained (3 are): not ok.
	if _, c, ok := b.Subscribe(1, 1); ok {
		t.Error("resume beyond the retained events said ok")
	} else {
		c()
	}
	// A full subscriber loses events, counted; the publisher never blocks.
	for range 4 { // the channel holds 3 (its buffer and the backlog's room)
		b.Publish(Event{})
	}
	if b.Dropped() != 1 {
		t.Errorf("dropped %d, want 1", b.Dropped())
	}
}

// Suspend: only an up guest suspends; a suspended VM resumes to where it
// was, is stopped (state discarded) or deleted; nothing boots it directly.
func TestSuspendTransitions(t *testing.T) {
	for _, c := range [][2]state{
		{ready, suspending}, {running, suspending}, {suspending, suspended}, {suspending, ready}, {suspending, running},
		{suspending, failed}, {suspending, stopped}, {suspended, ready}, {suspended, running}, {suspended, stopped}, {suspended, deleting},
	} {
		if err := Check(c[0], c[1]); err != nil {
			t.Errorf("%v", err)
		}
	}
	for _, c := range [][2]state{
		{booting, suspending}, {attesting, suspending}, {installing, suspending}, {stopped, suspending}, {stopped, suspended},
		{suspended, booting}, {suspended, failed}, {suspending, deleting}, {ready, suspended},
	} {
		if Allowed(c[0], c[1]) {
			t.Errorf("%s → %s is allowed", Name(c[0]), Name(c[1]))
		}
	}
}
