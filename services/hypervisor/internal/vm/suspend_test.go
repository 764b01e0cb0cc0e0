package vm

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// suspendDriver is the fake driver with the Suspender port: a suspend saves
// into a map and ends the run (QEMU's quit); the tests make either fail.
type suspendDriver struct {
	*fakeDriver
	mu          sync.Mutex
	saved       map[string]bool
	failSuspend error
	failResume  error
	aborted     []string
}

func withSuspend(d *fakeDriver) *suspendDriver {
	return &suspendDriver{fakeDriver: d, saved: map[string]bool{}}
}

func (d *suspendDriver) Suspend(_ context.Context, rec *storepb.VirtualMachine, run Run) error {
	d.mu.Lock()
	err := d.failSuspend
	if err == nil {
		d.saved[rec.GetId()] = true
	}
	d.mu.Unlock()
	if err != nil {
		return err // the guest runs on
	}
	run.(*fakeRun).exit(0)
	return nil
}

func (d *suspendDriver) AbortSuspend(_ context.Context, rec *storepb.VirtualMachine, _ Run) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.aborted = append(d.aborted, rec.GetId())
	delete(d.saved, rec.GetId())
	return nil
}

func (d *suspendDriver) Resume(_ context.Context, l Launch) (Run, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.failResume != nil {
		return nil, d.failResume
	}
	if !d.saved[l.Record.GetId()] {
		return nil, errors.New("no saved state")
	}
	d.fakeDriver.mu.Lock()
	defer d.fakeDriver.mu.Unlock()
	return d.newRunLocked(l.Record.GetId()), nil
}

func (d *suspendDriver) Saved(rec *storepb.VirtualMachine) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if !d.saved[rec.GetId()] {
		return errors.New("no saved state")
	}
	return nil
}

func (d *suspendDriver) DiscardSaved(rec *storepb.VirtualMachine) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.saved, rec.GetId())
	return nil
}

// suspendHarness is newHarness with the Suspender port.
func suspendHarness(t *testing.T) (*harness, *suspendDriver) {
	t.Helper()
	h := newHarness(t)
	h.m.Close() // restarted with the port, on the same store
	sd := withSuspend(h.drv)
	h.wrap = func(*fakeDriver) Driver { return sd }
	h.start()
	return h, sd
}

// Suspend and resume carry the same boot on: no launch, no provisioning, no
// boot registered with attestation; the record returns to ready.
func TestSuspendResumeSameBoot(t *testing.T) {
	h, sd := suspendHarness(t)
	v := h.create("web")
	id := v.GetId()
	launches, boots := h.drv.launchCount(), h.att.boots[id]
	first := h.drv.run(id)
	s, err := h.m.Suspend(context.Background(), id)
	if err != nil || s.GetState() != hypervisorv1.State_STATE_SUSPENDED || s.GetProcesses() != nil {
		t.Fatalf("suspend: %v %v", s, err)
	}
	if !first.reaped {
		t.Error("the suspended run was not reaped")
	}
	if _, err := h.m.Start(context.Background(), id); apierr.CodeOf(err) != apierr.Conflict || !strings.Contains(err.Error(), "resume") {
		t.Errorf("start of a suspended vm: %v", err)
	}
	r, err := h.m.Resume(context.Background(), id)
	if err != nil || r.GetState() != hypervisorv1.State_STATE_READY || r.GetProcesses() == nil || r.GetBootCount() != v.GetBootCount() ||
		r.GetAttestation().GetBoot() != v.GetAttestation().GetBoot() || r.GetReadyAt().AsTime() != v.GetReadyAt().AsTime() {
		t.Fatalf("resume: %v %v", r, err)
	}
	if h.drv.launchCount() != launches || h.att.boots[id] != boots {
		t.Errorf("resume launched (%d→%d) or registered a boot (%d→%d)", launches, h.drv.launchCount(), boots, h.att.boots[id])
	}
	if sd.Saved(&storepb.VirtualMachine{Id: id}) == nil {
		t.Error("the saved state outlived the resume")
	}
	// Resumed, it is supervised: a stop works.
	if v, err := h.m.Stop(context.Background(), id); err != nil || v.GetState() != hypervisorv1.State_STATE_STOPPED {
		t.Errorf("stop after resume: %v %v", v, err)
	}
	if c := h.m.SuspendCounters(); c.GetSuspendsTotal() != 1 || c.GetResumesTotal() != 1 || c.GetSuspendFailuresTotal()+c.GetResumeFailuresTotal() != 0 {
		t.Errorf("counters %v", c)
	}
	if _, err := h.m.Suspend(context.Background(), id); apierr.CodeOf(err) != apierr.Conflict {
		t.Errorf("suspend of a stopped vm: %v", err)
	}
}

// A suspend that fails leaves the VM running as it was; a resume that fails
// leaves it suspended with its state; stop discards a saved state.
func TestSuspendResumeFailures(t *testing.T) {
	h, sd := suspendHarness(t)
	id := h.create("web").GetId()
	sd.mu.Lock()
	sd.failSuspend = errors.New("migration failed: no space left on device")
	sd.mu.Unlock()
	if _, err := h.m.Suspend(context.Background(), id); apierr.CodeOf(err) != apierr.VMFailed {
		t.Fatalf("failing suspend: %v", err)
	}
	v, _ := h.m.Get(id)
	if v.GetState() != hypervisorv1.State_STATE_READY || v.GetProcesses() == nil || !strings.Contains(v.GetLastError(), "no space left") {
		t.Errorf("after a failed suspend: %v", v)
	}
	select {
	case <-h.drv.run(id).Done():
		t.Error("a failed suspend ended the run")
	default:
	}
	sd.mu.Lock()
	sd.failSuspend = nil
	sd.failResume = errors.New("saved state file is corrupt")
	sd.mu.Unlock()
	if _, err := h.m.Suspend(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	if _, err := h.m.Resume(context.Background(), id); apierr.CodeOf(err) != apierr.VMFailed {
		t.Fatalf("failing resume: %v", err)
	}
	v, _ = h.m.Get(id)
	if v.GetState() != hypervisorv1.State_STATE_SUSPENDED || v.GetProcesses() != nil || !strings.Contains(v.GetLastError(), "corrupt") || sd.Saved(&storepb.VirtualMachine{Id: id}) != nil {
		t.Errorf("after a failed resume: %v", v)
	}
	if v, err := h.m.Stop(context.Background(), id); err != nil || v.GetState() != hypervisorv1.State_STATE_STOPPED || sd.Saved(&storepb.VirtualMachine{Id: id}) == nil {
		t.Errorf("stop of a suspended vm: %v %v", v, err)
	}
	if c := h.m.SuspendCounters(); c.GetSuspendFailuresTotal() != 1 || c.GetResumeFailuresTotal() != 1 {
		t.Errorf("counters %v", c)
	}
}

// A hypervisor that died during a suspend: the next one continues a QEMU
// that still runs, keeps a whole saved state of one that is gone, and stops
// a VM that has neither. A suspended VM stays suspended and resumes.
func TestRestartDuringSuspend(t *testing.T) {
	h, sd := suspendHarness(t)
	running, saved, lost, asleep := h.create("running"), h.create("saved"), h.create("lost"), h.create("asleep")
	if _, err := h.m.Suspend(context.Background(), asleep.GetId()); err != nil {
		t.Fatal(err)
	}
	h.m.Close()
	for _, v := range []*hypervisorv1.VirtualMachine{running, saved, lost} {
		rec, err := h.st.GetVM(v.GetId())
		if err != nil {
			t.Fatal(err)
		}
		rec.State, rec.SuspendedFrom = hypervisorv1.State_STATE_SUSPENDING, hypervisorv1.State_STATE_READY
		if err := h.st.PutVM(rec); err != nil {
			t.Fatal(err)
		}
	}
	sd.mu.Lock()
	sd.saved[saved.GetId()] = true
	sd.mu.Unlock()
	h.drv.mu.Lock()
	h.drv.gone[saved.GetId()], h.drv.gone[lost.GetId()] = true, true
	h.drv.mu.Unlock()
	h.start()
	for id, want := range map[string]hypervisorv1.State{
		running.GetId(): hypervisorv1.State_STATE_READY, saved.GetId(): hypervisorv1.State_STATE_SUSPENDED,
		lost.GetId(): hypervisorv1.State_STATE_STOPPED, asleep.GetId(): hypervisorv1.State_STATE_SUSPENDED,
	} {
		v, _ := h.m.Get(id)
		if v.GetState() != want || (want == hypervisorv1.State_STATE_READY) != (v.GetProcesses() != nil) {
			t.Errorf("%s after the restart: %v, want %v", id, v, want)
		}
		if id != asleep.GetId() && v.GetLastError() == "" && want != hypervisorv1.State_STATE_SUSPENDED {
			t.Errorf("%s: no lastError", id)
		}
	}
	if !slicesEqual(sd.aborted, []string{running.GetId()}) {
		t.Errorf("aborted %v", sd.aborted)
	}
	for _, id := range []string{saved.GetId(), asleep.GetId()} {
		if v, err := h.m.Resume(context.Background(), id); err != nil || v.GetState() != hypervisorv1.State_STATE_READY {
			t.Errorf("resume of %s after the restart: %v %v", id, v, err)
		}
	}
}

func slicesEqual(a, b []string) bool { return strings.Join(a, ",") == strings.Join(b, ",") }
