package vm

import (
	"context"
	"fmt"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/proc"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/qemu"
)

// restore brings a loaded record in line with reality after a hypervisor
// (re)start: a live VM whose QEMU still runs is re-adopted (QMP reconnected,
// readiness re-attached, its supervisor resumed); anything else is settled
// with the reason in lastError.
func (m *Manager) restore(mc *machine) {
	rec := mc.rec
	state := rec.GetState()
	switch {
	case state == hypervisorv1.State_STATE_CREATING || state == hypervisorv1.State_STATE_DELETING:
		m.killLeftovers(rec)
		m.update(mc, func(r *hypervisorv1.VirtualMachine) {
			r.State = hypervisorv1.State_STATE_FAILED
			r.Processes = nil
			r.LastError = fmt.Sprintf("vm-manager restarted while the VM was %s; delete it", stateName(state))
		})
	case isLive(state):
		rt, err := m.adopt(rec)
		if err != nil {
			m.killLeftovers(rec)
			m.update(mc, func(r *hypervisorv1.VirtualMachine) {
				r.State = hypervisorv1.State_STATE_STOPPED
				r.Processes = nil
				r.LastError = fmt.Sprintf("vm-manager restarted while the VM was %s and could not reattach to its QEMU (%v); start the VM again", stateName(state), err)
			})
			return
		}
		m.log.Info("vm re-adopted", "vm", mc.id, "state", stateName(state), "qemu_pid", rt.qemu.PID)
		mc.mu.Lock()
		mc.run = rt
		mc.mu.Unlock()
		m.supervise(mc, rt)
		if state == hypervisorv1.State_STATE_STOPPING {
			// Resume the stop that was in progress.
			rt.stopping.Store(true)
			go func() {
				mc.op.Lock()
				defer mc.op.Unlock()
				m.powerOff(mc, rt)
			}()
		}
	}
}

// adopt re-attaches to a VM's processes through the handles in its record.
func (m *Manager) adopt(rec *hypervisorv1.VirtualMachine) (*runtime, error) {
	ph := rec.GetProcesses()
	if ph.GetQemu().GetPid() == 0 {
		return nil, fmt.Errorf("no qemu process recorded")
	}
	qp, err := proc.Adopt(proc.Handle{PID: int(ph.GetQemu().GetPid()), StartTicks: ph.GetQemu().GetStartTicks()})
	if err != nil {
		return nil, err
	}
	tp, err := proc.Adopt(proc.Handle{PID: int(ph.GetTpm().GetPid()), StartTicks: ph.GetTpm().GetStartTicks()})
	if err != nil {
		// QEMU without its vTPM cannot measure or quote: not a VM to keep.
		qp.Terminate(m.cfg.KillGrace)
		return nil, fmt.Errorf("swtpm: %w", err)
	}
	// swtpm serves one control client, and QEMU holds that connection: its
	// PID and start time are the check here, not a probe.
	ctx, cancel := context.WithTimeout(m.ctx, 5*time.Second)
	defer cancel()
	mon, err := qemu.Connect(ctx, rec.GetPaths().GetQmpSocket())
	if err != nil {
		qp.Terminate(m.cfg.KillGrace)
		tp.Terminate(m.cfg.KillGrace)
		return nil, fmt.Errorf("qmp: %w", err)
	}
	return &runtime{phase: rec.GetPhase(), qemu: qp, tpm: tp, mon: mon, settled: make(chan struct{})}, nil
}

// killLeftovers ends processes of a record that will not be adopted.
func (m *Manager) killLeftovers(rec *hypervisorv1.VirtualMachine) {
	for _, h := range []*hypervisorv1.Process{rec.GetProcesses().GetQemu(), rec.GetProcesses().GetTpm()} {
		if h.GetPid() == 0 {
			continue
		}
		if p, err := proc.Adopt(proc.Handle{PID: int(h.GetPid()), StartTicks: h.GetStartTicks()}); err == nil {
			m.log.Warn("ending a process no record will manage", "vm", rec.GetId(), "pid", p.PID)
			p.Terminate(m.cfg.KillGrace)
		}
	}
}
