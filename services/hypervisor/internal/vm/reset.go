package vm

import (
	"context"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// Every boot is a new boot. A reset the guest causes (a reboot, a panic with
// panic=, a triple fault) ends its run (the QEMU driver runs installed boots
// with -action reboot=shutdown and reports reason guest-reset), and the
// manager launches the next boot as reboot_vm would:
// the vTPM's keys are read again, attestation registers the boot before it
// runs, and the user-data gate is closed until that boot's own initrd quote
// verifies.

// A guest that resets more than MaxGuestResets times within GuestResetWindow
// (a boot loop) fails instead of being booted again.
const (
	MaxGuestResets   = 5
	GuestResetWindow = 5 * time.Minute
)

// noteReset records a guest reset and returns how many fall in the window.
func (mc *machine) noteReset(now time.Time) int {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	keep := mc.resets[:0]
	for _, t := range mc.resets {
		if now.Sub(t) < GuestResetWindow {
			keep = append(keep, t)
		}
	}
	mc.resets = append(keep, now)
	return len(mc.resets)
}

// relaunch starts the boot after a guest reset, unless a stop, a delete or
// the hypervisor's exit came first.
func (rn *Runner) relaunch(mc *machine) {
	mc.op.Lock()
	defer mc.op.Unlock()
	if _, err := rn.table.get(mc.id); err != nil {
		return // deleted meanwhile
	}
	mc.mu.Lock()
	waiting := mc.run == nil && mc.rec.GetState() == hypervisorv1.State_STATE_BOOTING
	mc.mu.Unlock()
	if !waiting {
		return
	}
	closing := rn.table.isClosing()
	if closing {
		rn.table.update(mc, func(r *storepb.VirtualMachine) {
			r.State = hypervisorv1.State_STATE_STOPPED
			r.LastError = "the guest rebooted while vm-manager shut down; start the VM"
		})
		return
	}
	// No call started this boot: it joins no trace.
	mc.setTrace(context.Background())
	if err := rn.launch(mc, hypervisorv1.Phase_PHASE_BOOT); err != nil {
		rn.table.update(mc, func(r *storepb.VirtualMachine) {
			r.State = hypervisorv1.State_STATE_FAILED
			r.LastError = "the guest rebooted and its next boot did not start: " + err.Error()
		})
	}
}

// observe notes why the run is about to end.
func (rt *runtime) observe(ev Shutdown) {
	if ev.Guest {
		rt.guestShutdown.Store(true)
	}
	if ev.Reset {
		rt.guestReset.Store(true)
	}
}

// drainEvents reads what is left once the run ended, until the channel closes.
func (rt *runtime) drainEvents(events <-chan Shutdown, d time.Duration) {
	timeout := time.After(d)
	for {
		select {
		case ev, ok := <-events:
			if !ok {
				return
			}
			rt.observe(ev)
		case <-timeout:
			return
		}
	}
}
