package driver

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/bootphase"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/proc"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/qemu"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// run is one VM's QEMU and swtpm, started or adopted.
type run struct {
	qemu  *proc.Process
	tpm   *proc.Process
	mon   *qemu.Monitor // nil only in tests
	cid   uint32
	grace time.Duration
	marks bootphase.Processes // zero for adopted runs
	// proxy relays a fork's first run's vTPM control channel (fork.go);
	// nil otherwise.
	proxy interface{ Close() error }

	once      sync.Once
	shutdowns chan vm.Shutdown
}

func (r *run) Processes() *storepb.Processes {
	return &storepb.Processes{
		Qemu: &storepb.Process{Pid: int32(r.qemu.PID), StartTicks: r.qemu.StartTicks},
		Tpm:  &storepb.Process{Pid: int32(r.tpm.PID), StartTicks: r.tpm.StartTicks},
	}
}

func (r *run) CID() uint32 { return r.cid }

// Launched says when the launch's processes started and answered.
func (r *run) Launched() bootphase.Processes { return r.marks }

// Shutdowns turns QMP's SHUTDOWN events into the manager's; a reset is
// reason guest-reset (QEMU runs installed boots with -action
// reboot=shutdown).
func (r *run) Shutdowns() <-chan vm.Shutdown {
	r.once.Do(func() {
		r.shutdowns = make(chan vm.Shutdown, qemu.EventBuffer)
		if r.mon == nil {
			close(r.shutdowns)
			return
		}
		go func() {
			defer close(r.shutdowns)
			for ev := range r.mon.Events() {
				if ev.Name != "SHUTDOWN" {
					continue
				}
				guest, _ := ev.Data["guest"].(bool)
				reason, _ := ev.Data["reason"].(string)
				r.shutdowns <- vm.Shutdown{Guest: guest, Reset: guest && reason == "guest-reset"}
			}
		}()
	})
	return r.shutdowns
}

func (r *run) Done() <-chan struct{} { return r.qemu.Done() }

func (r *run) ExitCode() (int, bool) { return r.qemu.ExitCode() }

func (r *run) PowerDown(ctx context.Context) error {
	if r.mon == nil {
		return fmt.Errorf("no QMP connection")
	}
	return r.mon.Powerdown(ctx)
}

func (r *run) Terminate(grace time.Duration) { r.qemu.Terminate(grace) }

// Detach closes QMP (QEMU serves one client: the next hypervisor's).
func (r *run) Detach() {
	if r.mon != nil {
		_ = r.mon.Close()
	}
}

// Reap closes QMP and ends swtpm: --terminate ends it with QEMU, this reaps
// a straggler.
func (r *run) Reap() {
	if r.mon != nil {
		_ = r.mon.Close()
	}
	r.tpm.Terminate(r.grace)
	if r.proxy != nil {
		_ = r.proxy.Close()
	}
}

// Adopt re-attaches to a VM's processes through the handles in its record.
func (d *Driver) Adopt(ctx context.Context, rec *storepb.VirtualMachine) (vm.Run, error) {
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
		qp.Terminate(d.cfg.KillGrace)
		return nil, fmt.Errorf("swtpm: %w", err)
	}
	// swtpm serves one control client, and QEMU holds that connection: its
	// PID and start time are the check here, not a probe.
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	mon, err := qemu.Connect(ctx, rec.GetPaths().GetQmpSocket())
	if err != nil {
		qp.Terminate(d.cfg.KillGrace)
		tp.Terminate(d.cfg.KillGrace)
		return nil, fmt.Errorf("qmp: %w", err)
	}
	return &run{qemu: qp, tpm: tp, mon: mon, cid: rec.GetCid(), grace: d.cfg.KillGrace}, nil
}

// Kill ends the processes of a record that will not be adopted.
func (d *Driver) Kill(rec *storepb.VirtualMachine) {
	for _, h := range []*storepb.Process{rec.GetProcesses().GetQemu(), rec.GetProcesses().GetTpm()} {
		if h.GetPid() == 0 {
			continue
		}
		if p, err := proc.Adopt(proc.Handle{PID: int(h.GetPid()), StartTicks: h.GetStartTicks()}); err == nil {
			d.log.Warn("ending a process no record will manage", "vm", rec.GetId(), "pid", p.PID)
			p.Terminate(d.cfg.KillGrace)
		}
	}
}

// Strays lists the QEMU and swtpm processes whose argv names a VM
// directory of this state directory, by VM id. swtpm and QEMU are started
// before the record lists them (QEMU once QMP answers), so a hypervisor that
// dies in between leaves processes only this scan finds.
func (d *Driver) Strays() map[string][]vm.Stray {
	names := []string{filepath.Base(d.cfg.QEMUBinary), filepath.Base(d.cfg.SwtpmBinary)}
	prefixes := []string{filepath.Join(d.cfg.StateDir, "vms") + "/"}
	if abs, err := filepath.Abs(prefixes[0]); err == nil && abs+"/" != prefixes[0] {
		prefixes = append(prefixes, abs+"/") // swtpm gets absolute paths
	}
	found, err := proc.Scan(func(argv []string) bool {
		return slices.Contains(names, filepath.Base(argv[0])) && vmOfArgv(argv, prefixes) != ""
	})
	if err != nil {
		d.log.Warn("cannot look for stray vm processes", "error", err)
		return nil
	}
	out := map[string][]vm.Stray{}
	for _, r := range found {
		id := vmOfArgv(r.Argv, prefixes)
		out[id] = append(out[id], vm.Stray{PID: r.PID, StartTicks: r.StartTicks, Binary: filepath.Base(r.Argv[0])})
	}
	return out
}

// vmOfArgv is the id of the VM directory an argument names: a path below one
// of prefixes at the start of the argument or after '=', ':' or ','
// (dir=…/tpm, path=…/qmp.sock, file:…/console.log).
func vmOfArgv(argv []string, prefixes []string) string {
	for _, a := range argv[1:] {
		for _, p := range prefixes {
			for i := 0; i+len(p) <= len(a); {
				j := strings.Index(a[i:], p)
				if j < 0 {
					break
				}
				at := i + j
				if at == 0 || strings.ContainsRune("=:,", rune(a[at-1])) {
					id, _, _ := strings.Cut(a[at+len(p):], "/")
					if vm.ValidID(id) {
						return id
					}
				}
				i = at + 1
			}
		}
	}
	return ""
}

// EndStray terminates a stray process (gone meanwhile: nothing to do).
func (d *Driver) EndStray(s vm.Stray) {
	if p, err := proc.Adopt(proc.Handle{PID: s.PID, StartTicks: s.StartTicks}); err == nil {
		p.Terminate(d.cfg.KillGrace)
	}
}
