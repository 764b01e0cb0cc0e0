package vm

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/lifecycle"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Suspender is a Driver that can save a running VM into its directory and
// start it again from there (internal/driver).
type Suspender interface {
	// Suspend saves the VM of run and ends its processes. On an error the
	// guest runs on as before and no state is kept.
	Suspend(ctx context.Context, rec *storepb.VirtualMachine, run Run) error
	// AbortSuspend cancels a suspend in flight on an adopted run (the
	// hypervisor restarted during one) and continues the guest.
	AbortSuspend(ctx context.Context, rec *storepb.VirtualMachine, run Run) error
	// Resume starts the VM from its saved state and continues it. On an
	// error nothing runs and the saved state is kept.
	Resume(ctx context.Context, l Launch) (Run, error)
	// Saved checks that rec has a whole saved state that is bound to it.
	Saved(rec *storepb.VirtualMachine) error
	// DiscardSaved removes rec's saved state.
	DiscardSaved(rec *storepb.VirtualMachine) error
}

// SuspendTimeout bounds a suspend's save and a resume's load.
const SuspendTimeout = 2 * time.Minute

// suspendStats are the suspend and resume counters.
type suspendStats struct {
	suspends, suspendFailures, resumes, resumeFailures atomic.Uint64
	suspendNanos, resumeNanos                          atomic.Int64 // the successful ones', summed
}

// SuspendCounters are the suspends and resumes since the hypervisor started
// (TelemetryService).
func (m *Manager) SuspendCounters() *hypervisorv1.SuspendCounters {
	c := &m.suspends
	return &hypervisorv1.SuspendCounters{
		SuspendsTotal: c.suspends.Load(), SuspendFailuresTotal: c.suspendFailures.Load(),
		ResumesTotal: c.resumes.Load(), ResumeFailuresTotal: c.resumeFailures.Load(),
		SuspendSecondsTotal: time.Duration(c.suspendNanos.Load()).Seconds(),
		ResumeSecondsTotal:  time.Duration(c.resumeNanos.Load()).Seconds(),
	}
}

func (rn *Runner) suspender() (Suspender, error) {
	s, ok := rn.driver.(Suspender)
	if !ok {
		return nil, apierr.Errorf(apierr.Conflict, "this host's driver cannot suspend VMs")
	}
	return s, nil
}

// savedState checks a record's saved state (nil: whole and bound to it).
func (rn *Runner) savedState(rec *storepb.VirtualMachine) error {
	s, err := rn.suspender()
	if err != nil {
		return err
	}
	return s.Saved(rec)
}

// Suspend saves a ready or running VM's RAM, devices and vTPM into its
// directory and ends its processes: state suspended. A suspend that fails
// leaves the VM running as it was, with lastError saying why.
func (m *Manager) Suspend(_ context.Context, id string) (*hypervisorv1.VirtualMachine, error) {
	return m.lockedSuspender(id, m.suspendLocked)
}

// lockedSuspender runs op under mc's op lock with the driver's Suspender
// (conflict when it has none).
func (m *Manager) lockedSuspender(id string, op func(Suspender, *machine) error) (*hypervisorv1.VirtualMachine, error) {
	return m.locked(id, func(mc *machine) error {
		s, err := m.runner.suspender()
		if err != nil {
			return err
		}
		return op(s, mc)
	})
}

func (m *Manager) suspendLocked(s Suspender, mc *machine) error {
	mc.mu.Lock()
	rt, state := mc.run, mc.rec.GetState()
	switch {
	case state == hypervisorv1.State_STATE_SUSPENDED:
		mc.mu.Unlock()
		return nil // idempotent
	case rt == nil || (state != hypervisorv1.State_STATE_READY && state != hypervisorv1.State_STATE_RUNNING &&
		(state != hypervisorv1.State_STATE_ATTESTING || !isMember(mc.rec))):
		mc.mu.Unlock()
		return apierr.Errorf(apierr.Conflict, "vm %s is %s; only a ready or running vm can be suspended", mc.id, lifecycle.Name(state))
	case rt.phase != hypervisorv1.Phase_PHASE_BOOT:
		mc.mu.Unlock()
		return apierr.Errorf(apierr.Conflict, "vm %s is installing; suspend it once it has booted", mc.id)
	}
	rt.suspending.Store(true)
	rec := m.table.updateLocked(mc, func(r *storepb.VirtualMachine) {
		r.SuspendedFrom = state
		r.State = hypervisorv1.State_STATE_SUSPENDING
	})
	mc.mu.Unlock()

	start := time.Now()
	// The caller going away does not cut a suspend short: it ends either
	// saved or running.
	sctx, cancel := context.WithTimeout(m.ctx, SuspendTimeout)
	defer cancel()
	if err := s.Suspend(sctx, rec, rt.proc); err != nil {
		m.suspends.suspendFailures.Add(1)
		if m.ctx.Err() != nil {
			// The hypervisor is stopping and has let go of QMP: the record
			// stays suspending, and the next hypervisor continues the guest
			// (restoreSuspending).
			return apierr.Errorf(apierr.Unavailable, "vm %s: vm-manager stopped during the suspend; the next start continues the vm", mc.id)
		}
		rt.suspending.Store(false)
		m.table.update(mc, func(r *storepb.VirtualMachine) {
			if r.GetState() == hypervisorv1.State_STATE_SUSPENDING { // not if QEMU died meanwhile
				r.State = r.GetSuspendedFrom()
				r.SuspendedFrom = hypervisorv1.State_STATE_UNSPECIFIED
				r.LastError = "suspend failed; the VM runs on: " + err.Error()
			}
		})
		return apierr.Errorf(apierr.VMFailed, "vm %s could not be suspended (it runs on): %v", mc.id, err)
	}
	<-rt.settled // the supervisor saw QEMU end and recorded suspended
	m.suspends.suspends.Add(1)
	m.suspends.suspendNanos.Add(int64(time.Since(start)))
	m.log.Info("vm suspended", "vm", mc.id, "seconds", time.Since(start).Seconds())
	return nil
}

// Resume starts a suspended VM from its saved state; the same boot carries
// on (attestation verdicts, the user-data gate, the vTPM's keys). A resume
// that fails keeps the state: the VM stays suspended with lastError.
func (m *Manager) Resume(_ context.Context, id string) (*hypervisorv1.VirtualMachine, error) {
	return m.lockedSuspender(id, m.resumeLocked)
}

func (m *Manager) resumeLocked(s Suspender, mc *machine) error {
	if m.table.isClosing() {
		return apierr.Errorf(apierr.Conflict, "vm-manager is shutting down")
	}
	rec, _ := mc.snapshot()
	if st := rec.GetState(); st != hypervisorv1.State_STATE_SUSPENDED {
		if isLive(st) {
			return nil // resumed already: idempotent
		}
		return apierr.Errorf(apierr.Conflict, "vm %s is %s; only a suspended vm can be resumed", mc.id, lifecycle.Name(st))
	}
	img, err := m.images.Get(rec.GetImage())
	if err != nil {
		return apierr.Errorf(apierr.Conflict, "vm %s: its image %s is no longer in the catalog", mc.id, rec.GetImage())
	}
	start := time.Now()
	rctx, cancel := context.WithTimeout(m.ctx, SuspendTimeout)
	defer cancel()
	run, err := s.Resume(rctx, Launch{Record: rec, Image: img, Phase: hypervisorv1.Phase_PHASE_BOOT, CIDTaken: m.table.cidTaken(mc.id)})
	if err != nil {
		m.resumeCounted(false, 0)
		m.table.update(mc, func(r *storepb.VirtualMachine) {
			r.LastError = "resume failed; the saved state is kept: " + err.Error()
		})
		return apierr.Errorf(apierr.VMFailed, "vm %s could not be resumed (it stays suspended): %v", mc.id, err)
	}
	rt := &runtime{phase: hypervisorv1.Phase_PHASE_BOOT, proc: run, settled: make(chan struct{})}
	m.table.update(mc, func(r *storepb.VirtualMachine) {
		to := r.GetSuspendedFrom()
		if to != hypervisorv1.State_STATE_READY && to != hypervisorv1.State_STATE_ATTESTING {
			to = hypervisorv1.State_STATE_RUNNING
		}
		r.State = to
		r.Phase = hypervisorv1.Phase_PHASE_BOOT
		r.Cid = run.CID()
		r.Processes = run.Processes()
		r.SuspendedFrom, r.SuspendedAt, r.LastError = hypervisorv1.State_STATE_UNSPECIFIED, nil, ""
		// The idle clock starts again: the time suspended is not idleness.
		if lt := r.GetLifetime(); lt.GetIdleTimeout() != "" {
			lt.LastActivityAt, lt.LastActivity = timestamppb.Now(), ActivityResume
		}
		mc.run = rt
	})
	m.runner.supervise(mc, rt) // re-attaches the NIC to the network switch
	m.resumeCounted(true, time.Since(start))
	m.log.Info("vm resumed", "vm", mc.id, "seconds", time.Since(start).Seconds())
	if err := s.DiscardSaved(rec); err != nil {
		m.log.Warn("could not remove the saved state after a resume", "vm", mc.id, "error", err)
	}
	m.wg.Go(func() { m.stepGuestClock(mc.id) })
	return nil
}

func (m *Manager) resumeCounted(ok bool, took time.Duration) {
	if !ok {
		m.suspends.resumeFailures.Add(1)
		return
	}
	m.suspends.resumes.Add(1)
	m.suspends.resumeNanos.Add(int64(took))
}

// stepGuestClock sets the guest's wall clock to the host's after a resume:
// it stopped while the VM was suspended, and under TCG nothing in the guest
// notices. It runs busybox date over the exec channel, retrying while the
// guest's network comes back.
func (m *Manager) stepGuestClock(id string) {
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(m.ctx, 10*time.Second)
		res, err := m.access.Exec(ctx, id, []string{"date", "-u", "-s", "@" + strconv.FormatInt(time.Now().Unix(), 10)})
		cancel()
		if err == nil && res.GetExitCode() == 0 {
			return
		}
		if m.ctx.Err() != nil || time.Now().After(deadline) {
			m.log.Warn("could not step the guest's clock after a resume", "vm", id, "error", err, "result", res)
			return
		}
		select {
		case <-m.ctx.Done():
			return
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// stopSuspended is stop_vm on a suspended VM: the saved state is discarded
// (like pulling the plug of a running VM); start_vm then boots afresh. also
// applies to the record in the same write.
func (m *Manager) stopSuspended(mc *machine, also func(*storepb.VirtualMachine)) error {
	if m.table.isClosing() {
		return apierr.Errorf(apierr.Conflict, "vm %s is suspended; its saved state is kept", mc.id)
	}
	s, err := m.runner.suspender()
	if err != nil {
		return err
	}
	rec, _ := mc.snapshot()
	if err := s.DiscardSaved(rec); err != nil {
		return apierr.Errorf(apierr.Internal, "vm %s: remove the saved state: %v", mc.id, err)
	}
	m.table.update(mc, func(r *storepb.VirtualMachine) {
		r.State = hypervisorv1.State_STATE_STOPPED
		r.SuspendedFrom, r.SuspendedAt = hypervisorv1.State_STATE_UNSPECIFIED, nil
		r.LastError = "stopped while suspended; the saved state was discarded"
		also(r)
	})
	return nil
}

// restoreSuspending settles a record a restart found suspending: a QEMU
// that still runs is continued (the suspend did not happen); a QEMU that
// is gone left a saved state (suspended) or not (stopped).
func (rn *Runner) restoreSuspending(mc *machine) {
	rec := mc.rec
	s, err := rn.suspender()
	if err != nil {
		return
	}
	run, err := rn.driver.Adopt(rn.ctx, rec)
	if err == nil {
		ctx, cancel := context.WithTimeout(rn.ctx, 30*time.Second)
		err = s.AbortSuspend(ctx, rec, run)
		cancel()
		if err == nil {
			rt := &runtime{phase: rec.GetPhase(), proc: run, settled: make(chan struct{})}
			rn.table.update(mc, func(r *storepb.VirtualMachine) {
				r.State = r.GetSuspendedFrom()
				if r.State != hypervisorv1.State_STATE_READY {
					r.State = hypervisorv1.State_STATE_RUNNING
				}
				r.SuspendedFrom = hypervisorv1.State_STATE_UNSPECIFIED
				r.LastError = "vm-manager restarted during a suspend; the VM runs on (suspend it again)"
				mc.run = rt
			})
			rn.supervise(mc, rt)
			return
		}
		rn.log.Warn("could not continue a vm whose suspend a restart cut short; ending it", "vm", mc.id, "error", err)
		run.Terminate(rn.cfg.KillGrace)
		<-run.Done()
		run.Reap()
	} else {
		rn.driver.Kill(rec)
	}
	if s.Saved(rec) == nil {
		rn.table.update(mc, func(r *storepb.VirtualMachine) {
			r.State, r.Processes = hypervisorv1.State_STATE_SUSPENDED, nil
			r.SuspendedAt = timestamppb.Now()
			r.LastError = "vm-manager restarted during a suspend, after the state was saved; resume the VM"
		})
		return
	}
	_ = s.DiscardSaved(rec)
	rn.table.update(mc, func(r *storepb.VirtualMachine) {
		r.State, r.Processes = hypervisorv1.State_STATE_STOPPED, nil
		r.SuspendedFrom = hypervisorv1.State_STATE_UNSPECIFIED
		r.LastError = fmt.Sprintf("vm-manager restarted during a suspend and the VM's processes were gone (%v); start the VM again", err)
	})
}

// discardStaleSaved removes the saved state of a VM a restart found neither
// suspended nor suspending: a resume that the previous hypervisor recorded
// but did not get to clean up after.
func (rn *Runner) discardStaleSaved(mc *machine) {
	s, err := rn.suspender()
	if err != nil {
		return
	}
	rec, _ := mc.snapshot()
	if st := rec.GetState(); st == hypervisorv1.State_STATE_SUSPENDED || st == hypervisorv1.State_STATE_SUSPENDING {
		return
	}
	if s.Saved(rec) == nil {
		rn.log.Info("removing the saved state of a vm that was resumed", "vm", mc.id)
	}
	if err := s.DiscardSaved(rec); err != nil {
		rn.log.Warn("could not remove a stale saved state", "vm", mc.id, "error", err)
	}
}
