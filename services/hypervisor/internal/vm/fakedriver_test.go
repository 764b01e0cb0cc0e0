package vm

import (
	"context"
	"errors"
	"sync"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// fakeDriver is the driver port: runs are goroutine-free stand-ins that the
// test ends, resets or lets power off.
type fakeDriver struct {
	mu          sync.Mutex
	nextPID     int32
	runs        map[string]*fakeRun // the current run of each VM
	launches    []Launch
	prepared    int
	provisioned int
	adopted     []string
	killed      []string
	strays      map[string][]Stray
	ended       []Stray
	// failLaunch, when set, fails the next launch.
	failLaunch error
	// badInstall, when set, is what VerifyInstall says of every install.
	badInstall error
	verified   int
	// gone are the VM ids whose recorded processes no longer run.
	gone map[string]bool
}

func newFakeDriver() *fakeDriver {
	return &fakeDriver{nextPID: 1000, runs: map[string]*fakeRun{}, gone: map[string]bool{}}
}

func (d *fakeDriver) Prepare(*storepb.VirtualMachine) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.prepared++
	return nil
}

// fakeAK is the "AK" the fake vTPM holds: stable per VM, as a real one is.
func fakeAK(id string) []byte { return []byte("ak of " + id) }

func (d *fakeDriver) Provision(_ context.Context, rec *storepb.VirtualMachine) (*storepb.TpmKeys, []string, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.provisioned++
	var created []string
	if rec.GetTpm() == nil {
		created = []string{"ek", "ak"}
	}
	return &storepb.TpmKeys{AkPublic: fakeAK(rec.GetId()), EkPublic: []byte("ek")}, created, nil
}

func (d *fakeDriver) VerifyInstall(*storepb.VirtualMachine, *hypervisorv1.Image) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.verified++
	return d.badInstall
}

func (d *fakeDriver) Launch(_ context.Context, l Launch) (Run, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.launches = append(d.launches, l)
	if err := d.failLaunch; err != nil {
		d.failLaunch = nil
		return nil, err
	}
	r := d.newRunLocked(l.Record.GetId())
	return r, nil
}

func (d *fakeDriver) newRunLocked(id string) *fakeRun {
	d.nextPID += 2
	r := &fakeRun{pid: d.nextPID, done: make(chan struct{}), shutdowns: make(chan Shutdown, 4)}
	d.runs[id] = r
	return r
}

func (d *fakeDriver) Adopt(_ context.Context, rec *storepb.VirtualMachine) (Run, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.gone[rec.GetId()] || rec.GetProcesses() == nil {
		return nil, errors.New("process is gone")
	}
	d.adopted = append(d.adopted, rec.GetId())
	r := d.newRunLocked(rec.GetId())
	r.pid = rec.GetProcesses().GetQemu().GetPid()
	return r, nil
}

func (d *fakeDriver) Kill(rec *storepb.VirtualMachine) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.killed = append(d.killed, rec.GetId())
}

func (d *fakeDriver) Strays() map[string][]Stray {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.strays
}

func (d *fakeDriver) EndStray(s Stray) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.ended = append(d.ended, s)
}

// run returns a VM's current run.
func (d *fakeDriver) run(id string) *fakeRun {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.runs[id]
}

func (d *fakeDriver) launchCount() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.launches)
}

// fakeRun is one run. The guest honours a power-down unless deaf is set.
type fakeRun struct {
	pid       int32
	done      chan struct{}
	once      sync.Once
	shutdowns chan Shutdown
	mu        sync.Mutex
	code      int
	known     bool
	deaf      bool
	detached  bool
	reaped    bool
}

func (r *fakeRun) Processes() *storepb.Processes {
	return &storepb.Processes{Qemu: &storepb.Process{Pid: r.pid, StartTicks: 7}, Tpm: &storepb.Process{Pid: r.pid + 1, StartTicks: 7}}
}
func (r *fakeRun) CID() uint32                { return 0 }
func (r *fakeRun) Shutdowns() <-chan Shutdown { return r.shutdowns }
func (r *fakeRun) Done() <-chan struct{}      { return r.done }
func (r *fakeRun) Terminate(time.Duration)    { r.exit(-1) }
func (r *fakeRun) ExitCode() (code int, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.code, r.known
}

func (r *fakeRun) PowerDown(context.Context) error {
	r.mu.Lock()
	deaf := r.deaf
	r.mu.Unlock()
	if !deaf {
		r.shutdowns <- Shutdown{Guest: true}
		r.exit(0)
	}
	return nil
}

// reset is the guest rebooting itself.
func (r *fakeRun) reset() {
	r.shutdowns <- Shutdown{Guest: true, Reset: true}
	r.exit(0)
}

// exit ends the run with a known exit code.
func (r *fakeRun) exit(code int) {
	r.once.Do(func() {
		r.mu.Lock()
		r.code, r.known = code, true
		r.mu.Unlock()
		close(r.shutdowns)
		close(r.done)
	})
}

func (r *fakeRun) Detach() { r.mu.Lock(); r.detached = true; r.mu.Unlock() }
func (r *fakeRun) Reap()   { r.mu.Lock(); r.reaped = true; r.mu.Unlock() }
