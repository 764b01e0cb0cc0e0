package vm

import (
	"context"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/lifecycle"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

func isLive(s hypervisorv1.State) bool {
	switch s {
	case hypervisorv1.State_STATE_INSTALLING, hypervisorv1.State_STATE_BOOTING, hypervisorv1.State_STATE_ATTESTING,
		hypervisorv1.State_STATE_READY, hypervisorv1.State_STATE_RUNNING, hypervisorv1.State_STATE_STOPPING:
		return true
	}
	return false
}

// Start boots a stopped or failed VM from its disk (phase boot).
func (m *Manager) Start(ctx context.Context, id string) (*hypervisorv1.VirtualMachine, error) {
	return m.locked(id, func(mc *machine) error { return m.startLocked(ctx, mc) })
}

// locked runs op on a VM under its operation lock and returns the record op
// left.
func (m *Manager) locked(id string, op func(*machine) error) (*hypervisorv1.VirtualMachine, error) {
	mc, err := m.table.get(id)
	if err != nil {
		return nil, err
	}
	mc.op.Lock()
	defer mc.op.Unlock()
	if err := op(mc); err != nil {
		return nil, err
	}
	rec, _ := mc.snapshot()
	return View(rec), nil
}

// startLocked boots mc; the boot continues the trace of ctx's call.
func (m *Manager) startLocked(ctx context.Context, mc *machine) error {
	if m.table.isClosing() {
		return apierr.Errorf(apierr.Conflict, "vm-manager is shutting down")
	}
	rec, _ := mc.snapshot()
	switch rec.GetState() {
	case hypervisorv1.State_STATE_STOPPED, hypervisorv1.State_STATE_FAILED:
	case hypervisorv1.State_STATE_SUSPENDED, hypervisorv1.State_STATE_SUSPENDING:
		return apierr.Errorf(apierr.Conflict, "vm %s is %s: resume it (resume_vm), or stop it to discard the saved state and then start it", mc.id, lifecycle.Name(rec.GetState()))
	default:
		return apierr.Errorf(apierr.Conflict, "vm %s is %s; only a stopped or failed vm can be started", mc.id, lifecycle.Name(rec.GetState()))
	}
	img, err := m.images.Get(rec.GetImage())
	if err != nil {
		return apierr.Errorf(apierr.Conflict, "vm %s: its image %s is no longer in the catalog", mc.id, rec.GetImage())
	}
	if img.GetKind() == hypervisorv1.ImageKind_IMAGE_KIND_UKI && rec.GetInstalledAt() == nil {
		return apierr.Errorf(apierr.Conflict, "vm %s was never installed; delete it and create it again", mc.id)
	}
	mc.mu.Lock()
	mc.resets = nil // a boot loop's count starts again with the caller's start
	mc.mu.Unlock()
	mc.setTrace(ctx)
	if err := m.runner.launch(mc, hypervisorv1.Phase_PHASE_BOOT); err != nil {
		return apierr.Errorf(apierr.VMFailed, "vm %s could not start: %v", mc.id, err)
	}
	return nil
}

// Stop powers the VM down (ACPI, then SIGTERM, then SIGKILL) and returns the
// settled record. The caller going away does not cut the stop short.
func (m *Manager) Stop(_ context.Context, id string) (*hypervisorv1.VirtualMachine, error) {
	return m.locked(id, m.stopLocked)
}

func (m *Manager) stopLocked(mc *machine) error { return m.stopLockedWith(mc, nil) }

// stopLockedWith is stopLocked that also applies also to the record, in the
// write that makes the VM stopping (or stopped).
func (m *Manager) stopLockedWith(mc *machine, also func(*storepb.VirtualMachine)) error {
	if also == nil {
		also = func(*storepb.VirtualMachine) {}
	}
	mc.mu.Lock()
	rt, state := mc.run, mc.rec.GetState()
	if state == hypervisorv1.State_STATE_DELETING {
		mc.mu.Unlock()
		return apierr.Errorf(apierr.Conflict, "vm %s is being deleted", mc.id)
	}
	if state == hypervisorv1.State_STATE_SUSPENDED {
		mc.mu.Unlock()
		return m.stopSuspended(mc, also)
	}
	if rt == nil && state == hypervisorv1.State_STATE_BOOTING {
		// Between a guest reset and its next boot: that boot will not start.
		m.table.updateLocked(mc, func(rec *storepb.VirtualMachine) { rec.State = hypervisorv1.State_STATE_STOPPED; also(rec) })
		mc.mu.Unlock()
		return nil
	}
	if rt == nil || !isLive(state) {
		mc.mu.Unlock()
		return apierr.Errorf(apierr.Conflict, "vm %s is not running (state %s)", mc.id, lifecycle.Name(state))
	}
	rt.stopping.Store(true)
	m.table.updateLocked(mc, func(rec *storepb.VirtualMachine) { rec.State = hypervisorv1.State_STATE_STOPPING; also(rec) })
	mc.mu.Unlock()
	m.runner.powerOff(mc, rt)
	return nil
}

// powerOff asks the guest to power down, escalates after the stop timeout and
// waits until the supervisor has settled the record.
func (rn *Runner) powerOff(mc *machine, rt *runtime) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	if err := rt.proc.PowerDown(ctx); err != nil {
		rn.log.Warn("power-down failed", "vm", mc.id, "error", err)
	}
	cancel()
	select {
	case <-rt.proc.Done():
	case <-time.After(rn.cfg.StopTimeout):
		rn.log.Warn("guest did not power off within the stop timeout; terminating it", "vm", mc.id, "timeout", rn.cfg.StopTimeout)
		rt.proc.Terminate(rn.cfg.KillGrace)
	}
	<-rt.settled
}

// Reboot is Stop followed by Start.
func (m *Manager) Reboot(ctx context.Context, id string) (*hypervisorv1.VirtualMachine, error) {
	return m.locked(id, func(mc *machine) error {
		if rec, _ := mc.snapshot(); isLive(rec.GetState()) {
			if err := m.stopLocked(mc); err != nil {
				return err
			}
		}
		return m.startLocked(ctx, mc)
	})
}

// Delete stops the VM and removes its files and record. Not undoable.
func (m *Manager) Delete(_ context.Context, id string) error {
	mc, err := m.table.get(id)
	if err != nil {
		return err
	}
	mc.mu.Lock()
	if mc.rec.GetState() == hypervisorv1.State_STATE_DELETING && mc.run != nil {
		mc.mu.Unlock()
		return apierr.Errorf(apierr.Conflict, "vm %s is already being deleted", id)
	}
	mc.mu.Unlock()
	mc.op.Lock()
	defer mc.op.Unlock()
	if _, err := m.table.get(id); err != nil {
		return err // deleted while we waited for the op lock
	}
	mc.mu.Lock()
	rt := mc.run
	if rt != nil {
		rt.stopping.Store(true)
	}
	m.table.updateLocked(mc, func(rec *storepb.VirtualMachine) { rec.State = hypervisorv1.State_STATE_DELETING })
	mc.mu.Unlock()
	if rt != nil {
		m.runner.powerOff(mc, rt)
	}
	m.access.closeForwards(mc, false)
	if err := m.drop(mc); err != nil {
		return err
	}
	if m.verifier != nil {
		if err := m.forget(id); err != nil {
			m.log.Warn("attestation could not forget the vm yet; retrying in the background", "vm", id, "error", err)
		}
	}
	m.log.Info("vm deleted", "vm", id)
	return nil
}
