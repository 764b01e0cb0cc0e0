package vm

import (
	"context"
	"fmt"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/lifecycle"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

func (m *Manager) deadline(w hypervisorv1.WaitFor) time.Duration {
	switch w {
	case hypervisorv1.WaitFor_WAIT_FOR_NONE:
		return 0
	case hypervisorv1.WaitFor_WAIT_FOR_INSTALLED:
		return m.cfg.InstallTimeout + m.cfg.StopTimeout
	default:
		return m.cfg.InstallTimeout + m.cfg.StopTimeout + m.cfg.BootTimeout
	}
}

func reached(rec *storepb.VirtualMachine, w hypervisorv1.WaitFor) bool {
	switch w {
	case hypervisorv1.WaitFor_WAIT_FOR_NONE:
		return true
	case hypervisorv1.WaitFor_WAIT_FOR_INSTALLED:
		return rec.GetInstalledAt() != nil
	case hypervisorv1.WaitFor_WAIT_FOR_ATTESTED:
		return rec.GetBootedAt() != nil && rec.GetAttestation().GetUserDataReleased()
	default:
		return rec.GetReadyAt() != nil
	}
}

// wait blocks until the VM reaches w, fails, or the deadline passes; the VM
// keeps running in every case.
func (m *Manager) wait(ctx context.Context, mc *machine, w hypervisorv1.WaitFor, d time.Duration) (*storepb.VirtualMachine, error) {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		rec, changed := mc.snapshot()
		if reached(rec, w) {
			return rec, nil
		}
		switch s := rec.GetState(); s {
		case hypervisorv1.State_STATE_FAILED:
			return nil, failedErr(rec, fmt.Sprintf("vm %s failed before %s", rec.GetId(), waitName(w)))
		case hypervisorv1.State_STATE_STOPPING, hypervisorv1.State_STATE_STOPPED, hypervisorv1.State_STATE_DELETING:
			return nil, failedErr(rec, fmt.Sprintf("vm is %s", lifecycle.Name(s)))
		}
		select {
		case <-changed:
		case <-timer.C:
			return nil, apierr.Errorf(apierr.Timeout, "vm %s did not reach %s within %s (state %s)", rec.GetId(), waitName(w), fmtDuration(d), lifecycle.Name(rec.GetState()))
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// failedErr is the contract's message for a create that did not reach its milestone.
func failedErr(rec *storepb.VirtualMachine, cause string) error {
	state := lifecycle.Name(rec.GetState())
	if le := rec.GetLastError(); le != "" {
		state += ": " + le
	}
	return apierr.Errorf(apierr.VMFailed, "%s; vm %s is %s (follow it with get_vm %s, delete it with delete_vm)", cause, rec.GetId(), state, rec.GetId())
}
