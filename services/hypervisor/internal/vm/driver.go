package vm

import (
	"context"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// Driver runs the processes a VM is made of: QEMU and swtpm today
// (internal/driver). The manager decides what happens when (states, timers,
// readiness, attestation); the driver knows how to start, find and end the
// processes. Its methods must be safe for concurrent use on different VMs.
type Driver interface {
	// Prepare writes what the driver needs into a new VM's directory (the
	// firmware's variable store, the disk).
	Prepare(rec *storepb.VirtualMachine) error
	// Provision readies the VM's vTPM for a launch: no process may use it
	// meanwhile. It returns the keys the record keeps, and what it made or
	// replaced (empty when the vTPM held everything already).
	Provision(ctx context.Context, rec *storepb.VirtualMachine) (keys *storepb.TpmKeys, created []string, err error)
	// VerifyInstall says whether an installer that powered off left the
	// image's disk on the VM's volume.
	VerifyInstall(rec *storepb.VirtualMachine, img *hypervisorv1.Image) error
	// Launch starts the VM's processes for one phase.
	Launch(ctx context.Context, l Launch) (Run, error)
	// Adopt attaches to the processes a record names, started by an earlier
	// hypervisor.
	Adopt(ctx context.Context, rec *storepb.VirtualMachine) (Run, error)
	// Kill ends the processes a record names that will not be adopted.
	Kill(rec *storepb.VirtualMachine)
	// Strays lists, by VM id, the processes that name a VM directory of
	// this state directory (a launch the previous hypervisor died in leaves
	// some no record lists).
	Strays() map[string][]Stray
	// EndStray ends one of them.
	EndStray(s Stray)
}

// Launch is one launch's request.
type Launch struct {
	Record *storepb.VirtualMachine
	Image  *hypervisorv1.Image
	Phase  hypervisorv1.Phase
	// CIDTaken says whether another VM holds a vsock CID.
	CIDTaken func(cid uint32) bool
}

// Stray is a process of a VM directory.
type Stray struct {
	PID        int
	StartTicks uint64
	Binary     string
}

// Run is one launch's (or adoption's) live processes.
type Run interface {
	// Processes are the handles the record keeps.
	Processes() *storepb.Processes
	// CID is the vsock CID the VM got; 0 without vsock.
	CID() uint32
	// Shutdowns delivers why the run is about to end, as far as the
	// hypervisor hears it (QMP SHUTDOWN); closed when that channel ends.
	Shutdowns() <-chan Shutdown
	// Done is closed when the VM's main process (QEMU) has exited.
	Done() <-chan struct{}
	// ExitCode is the main process's exit status, when it is known (not for
	// adopted processes).
	ExitCode() (code int, known bool)
	// PowerDown presses the ACPI power button; the guest may ignore it.
	PowerDown(ctx context.Context) error
	// Terminate ends the main process: SIGTERM, SIGKILL after grace.
	Terminate(grace time.Duration)
	// Detach lets go of the run and leaves its processes running, for the
	// next hypervisor to adopt.
	Detach()
	// Reap cleans up after Done: the monitor, a straggling vTPM.
	Reap()
}

// Shutdown is a run's end as the guest asked for it.
type Shutdown struct {
	// Guest: the guest powered off or reset (not the host).
	Guest bool
	// Reset: the guest reset (a reboot, a panic with panic=, a triple fault).
	Reset bool
}
