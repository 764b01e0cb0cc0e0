package vm

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/proc"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/qemu"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/store/storepb"
)

// restore brings a loaded record in line with reality after a hypervisor
// (re)start: a live VM whose QEMU still runs is re-adopted (QMP reconnected,
// readiness re-attached, its supervisor resumed); anything else is settled
// with the reason in lastError. Processes of the VM that the record does not
// list (strays: a launch the previous hypervisor died in) are ended.
func (m *Manager) restore(mc *machine, strays []proc.Running) {
	before := mc.rec.GetState()
	m.restoreRecord(mc)
	mc.mu.Lock()
	var keep []int
	if rt := mc.run; rt != nil {
		keep = []int{rt.qemu.PID, rt.tpm.PID}
	}
	mc.mu.Unlock()
	if m.endStrays(mc.id, strays, keep) > 0 && (before == hypervisorv1.State_STATE_STOPPED || before == hypervisorv1.State_STATE_FAILED) {
		// A start or reboot was launching it: say why it is still down.
		m.update(mc, func(r *storepb.VirtualMachine) {
			r.LastError = "vm-manager restarted while the VM was starting; start the VM again"
		})
	}
}

func (m *Manager) restoreRecord(mc *machine) {
	rec := mc.rec
	state := rec.GetState()
	switch {
	case state == hypervisorv1.State_STATE_CREATING || state == hypervisorv1.State_STATE_DELETING:
		m.killLeftovers(rec)
		m.update(mc, func(r *storepb.VirtualMachine) {
			r.State = hypervisorv1.State_STATE_FAILED
			r.Processes = nil
			r.LastError = fmt.Sprintf("vm-manager restarted while the VM was %s; delete it", stateName(state))
		})
	case isLive(state):
		rt, err := m.adopt(rec)
		if err != nil {
			m.killLeftovers(rec)
			m.update(mc, func(r *storepb.VirtualMachine) {
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
func (m *Manager) adopt(rec *storepb.VirtualMachine) (*runtime, error) {
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
func (m *Manager) killLeftovers(rec *storepb.VirtualMachine) {
	for _, h := range []*storepb.Process{rec.GetProcesses().GetQemu(), rec.GetProcesses().GetTpm()} {
		if h.GetPid() == 0 {
			continue
		}
		if p, err := proc.Adopt(proc.Handle{PID: int(h.GetPid()), StartTicks: h.GetStartTicks()}); err == nil {
			m.log.Warn("ending a process no record will manage", "vm", rec.GetId(), "pid", p.PID)
			p.Terminate(m.cfg.KillGrace)
		}
	}
}

// findStrays lists the QEMU and swtpm processes whose argv names a VM
// directory of this state directory, by VM id. swtpm and QEMU are started
// before the record lists them (QEMU once QMP answers), so a hypervisor that
// dies in between leaves processes only this scan finds.
func (m *Manager) findStrays() map[string][]proc.Running {
	names := []string{filepath.Base(m.cfg.QEMUBinary), filepath.Base(m.cfg.SwtpmBinary)}
	prefixes := []string{filepath.Join(m.cfg.StateDir, "vms") + "/"}
	if abs, err := filepath.Abs(prefixes[0]); err == nil && abs+"/" != prefixes[0] {
		prefixes = append(prefixes, abs+"/") // swtpm gets absolute paths
	}
	found, err := proc.Scan(func(argv []string) bool {
		return slices.Contains(names, filepath.Base(argv[0])) && vmOfArgv(argv, prefixes) != ""
	})
	if err != nil {
		m.log.Warn("cannot look for stray vm processes", "error", err)
		return nil
	}
	out := map[string][]proc.Running{}
	for _, r := range found {
		id := vmOfArgv(r.Argv, prefixes)
		out[id] = append(out[id], r)
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
					if vmID.MatchString(id) {
						return id
					}
				}
				i = at + 1
			}
		}
	}
	return ""
}

// endStrays terminates a VM's processes other than keep (the adopted ones)
// and returns how many it ended.
func (m *Manager) endStrays(id string, strays []proc.Running, keep []int) (ended int) {
	for _, r := range strays {
		if slices.Contains(keep, r.PID) {
			continue
		}
		p, err := proc.Adopt(r.Handle)
		if err != nil {
			continue // gone meanwhile
		}
		m.log.Warn("ending a vm process no record lists (a launch interrupted by a restart?)", "vm", id, "pid", p.PID, "binary", filepath.Base(r.Argv[0]))
		p.Terminate(m.cfg.KillGrace)
		ended++
	}
	return ended
}
