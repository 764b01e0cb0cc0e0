package vm

import (
	"fmt"
	"slices"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/lifecycle"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// restore brings a loaded record in line with reality after a hypervisor
// (re)start: a live VM whose QEMU still runs is re-adopted (QMP reconnected,
// readiness re-attached, its supervisor resumed); anything else is settled
// with the reason in lastError. Processes of the VM that the record does not
// list (strays: a launch the previous hypervisor died in) are ended.
func (rn *Runner) restore(mc *machine, strays []Stray) {
	before := mc.rec.GetState()
	rn.restoreRecord(mc)
	rn.discardStaleSaved(mc)
	mc.mu.Lock()
	var keep []int
	if rt := mc.run; rt != nil {
		p := rt.proc.Processes()
		keep = []int{int(p.GetQemu().GetPid()), int(p.GetTpm().GetPid())}
	}
	mc.mu.Unlock()
	if rn.endStrays(mc.id, strays, keep) > 0 && (before == hypervisorv1.State_STATE_STOPPED || before == hypervisorv1.State_STATE_FAILED) {
		// A start or reboot was launching it: say why it is still down.
		rn.table.update(mc, func(r *storepb.VirtualMachine) {
			r.LastError = "vm-manager restarted while the VM was starting; start the VM again"
		})
	}
}

func (rn *Runner) restoreRecord(mc *machine) {
	rec := mc.rec
	state := rec.GetState()
	switch {
	case state == hypervisorv1.State_STATE_CREATING || state == hypervisorv1.State_STATE_DELETING:
		rn.driver.Kill(rec)
		rn.table.update(mc, func(r *storepb.VirtualMachine) {
			r.State = hypervisorv1.State_STATE_FAILED
			r.Processes = nil
			r.LastError = fmt.Sprintf("vm-manager restarted while the VM was %s; delete it", lifecycle.Name(state))
		})
	case state == hypervisorv1.State_STATE_SUSPENDING:
		rn.restoreSuspending(mc)
	case isLive(state):
		run, err := rn.driver.Adopt(rn.ctx, rec)
		if err != nil {
			rn.driver.Kill(rec)
			rn.table.update(mc, func(r *storepb.VirtualMachine) {
				r.State = hypervisorv1.State_STATE_STOPPED
				r.Processes = nil
				r.LastError = fmt.Sprintf("vm-manager restarted while the VM was %s and could not reattach to its QEMU (%v); start the VM again", lifecycle.Name(state), err)
			})
			return
		}
		rt := &runtime{phase: rec.GetPhase(), proc: run, settled: make(chan struct{})}
		rn.log.Info("vm re-adopted", "vm", mc.id, "state", lifecycle.Name(state), "qemu_pid", run.Processes().GetQemu().GetPid())
		mc.mu.Lock()
		mc.run = rt
		mc.mu.Unlock()
		rn.supervise(mc, rt)
		if state == hypervisorv1.State_STATE_STOPPING {
			// Resume the stop that was in progress.
			rt.stopping.Store(true)
			go func() {
				mc.op.Lock()
				defer mc.op.Unlock()
				rn.powerOff(mc, rt)
			}()
		}
	}
}

// endStrays ends a VM's processes other than keep (the adopted ones) and
// returns how many it ended.
func (rn *Runner) endStrays(id string, strays []Stray, keep []int) (ended int) {
	for _, s := range strays {
		if slices.Contains(keep, s.PID) {
			continue
		}
		rn.log.Warn("ending a vm process no record lists (a launch interrupted by a restart?)", "vm", id, "pid", s.PID, "binary", s.Binary)
		rn.driver.EndStray(s)
		ended++
	}
	return ended
}
