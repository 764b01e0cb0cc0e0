// Package lifecycle is a VM's state machine: the one table of the state
// changes that are legal (contract §3.2), and the change events that every
// change of a VM record emits, numbered, for whoever follows them.
package lifecycle

import (
	"fmt"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/enumname"
)

type state = hypervisorv1.State

// Short names of the states, for the table below: one a line, so its
// halves look alike; kept, there is nothing to share.
const (
	creating   = hypervisorv1.State_STATE_CREATING
	installing = hypervisorv1.State_STATE_INSTALLING
	booting    = hypervisorv1.State_STATE_BOOTING
	attesting  = hypervisorv1.State_STATE_ATTESTING
	ready      = hypervisorv1.State_STATE_READY
	running    = hypervisorv1.State_STATE_RUNNING
	stopping   = hypervisorv1.State_STATE_STOPPING
	stopped    = hypervisorv1.State_STATE_STOPPED
	failed     = hypervisorv1.State_STATE_FAILED
	deleting   = hypervisorv1.State_STATE_DELETING
	suspending = hypervisorv1.State_STATE_SUSPENDING
	suspended  = hypervisorv1.State_STATE_SUSPENDED
)

// transitions lists, for each state, where a VM may go from there. A record
// may always stay in its state (a field other than the state changes).
var transitions = map[state][]state{
	// Resources allocated: the installer or the boot started; a restart
	// caught it (failed); a delete.
	creating: {installing, booting, failed, deleting},
	// The installer ended: the installed boot, a shutdown before it, a
	// failure; or a stop or delete.
	installing: {booting, stopped, failed, stopping, deleting},
	// The first nonce (attesting), READY=1, the boot timeout (running), a
	// reset inside the guest (booting: a new boot), a stop or delete, the
	// process ending (stopped, failed).
	booting: {attesting, ready, running, booting, stopping, stopped, failed, deleting},
	// A warm pool's member is suspended while it waits for its user-data
	// (suspending), after its initrd quote verified.
	attesting: {ready, running, booting, stopping, stopped, failed, deleting, suspending},
	ready:     {booting, stopping, stopped, failed, deleting, suspending},
	// A late READY=1.
	running: {ready, booting, stopping, stopped, failed, deleting, suspending},
	// The process exited (stopped; failed when it died of it), or a delete
	// took over.
	stopping: {stopped, failed, deleting},
	// start_vm, reboot_vm, delete_vm.
	stopped: {booting, deleting},
	failed:  {booting, deleting},
	// A restart caught the delete.
	deleting: {failed},

	// Suspend (issue 19). The state is saved (suspended); the suspend
	// failed and the guest runs on (back to ready or running); QEMU died
	// meanwhile (stopped, failed).
	suspending: {suspended, ready, running, attesting, stopped, failed},
	// resume_vm returns to where the suspend started (attesting: a claimed
	// pool member); stop_vm discards the saved state; delete_vm.
	suspended: {ready, running, attesting, stopped, deleting},
}

// Allowed says whether a VM may go from one state to the other.
func Allowed(from, to state) bool {
	if from == to {
		return true
	}
	for _, s := range transitions[from] {
		if s == to {
			return true
		}
	}
	return false
}

// Check is Allowed as an error naming the change.
func Check(from, to state) error {
	if Allowed(from, to) {
		return nil
	}
	return fmt.Errorf("illegal state change %s → %s", Name(from), Name(to))
}

// Name is a state as the API spells it: "ready", "stopped".
func Name(s state) string { return enumname.Of(s) }
