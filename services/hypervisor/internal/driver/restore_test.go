package driver_test

import (
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/driver"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/network"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/notify"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

type noImages struct{}

func (noImages) Get(string) (*hypervisorv1.Image, error) { return nil, apierr.ErrNotFound }
func (noImages) Default() (*hypervisorv1.Image, error)   { return nil, apierr.ErrNotFound }

// The manager restarted over the real driver: a hypervisor SIGKILLed between starting swtpm and QEMU and recording them
// (a create, start or reboot in flight; found by the fault suite) left both
// running under a record that lists no processes. The next hypervisor ends
// every QEMU or swtpm that names a VM directory of its state directory and
// is not the adopted process of that VM, and leaves other processes alone.
func TestRestoreEndsStrayProcesses(t *testing.T) {
	dir := t.TempDir()
	bin := t.TempDir()
	qemuBin, swtpmBin := filepath.Join(bin, "qemu-system-x86_64"), filepath.Join(bin, "swtpm")
	for _, l := range []string{qemuBin, swtpmBin} {
		if err := os.Symlink("/bin/sh", l); err != nil {
			t.Fatal(err)
		}
	}
	st, err := vmstore.Open(filepath.Join(dir, "hypervisor.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	vmDir := func(id string) string { return filepath.Join(dir, "vms", id) }
	for id, state := range map[string]hypervisorv1.State{
		"0a0b0c01": hypervisorv1.State_STATE_CREATING, // create in flight
		"0a0b0c02": hypervisorv1.State_STATE_STOPPED,  // start or reboot in flight
	} {
		if err := os.MkdirAll(vmDir(id), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := st.PutVM(&storepb.VirtualMachine{Id: id, Name: "n" + id, State: state, Paths: &hypervisorv1.Paths{Dir: vmDir(id)}}); err != nil {
			t.Fatal(err)
		}
	}
	// sh stands in for both binaries; its extra argument is the one that
	// names the VM directory, as QEMU's and swtpm's do.
	pids := map[<-chan struct{}]int{}
	start := func(binary, arg string) <-chan struct{} {
		cmd := exec.Command(binary, "-c", "sleep 60; true", arg)
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) })
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		pids[done] = cmd.Process.Pid
		return done
	}
	strays := []<-chan struct{}{
		start(swtpmBin, "dir="+vmDir("0a0b0c01")+"/tpm"),
		start(qemuBin, "path="+vmDir("0a0b0c01")+"/qmp.sock,server=on,wait=off"),
		start(swtpmBin, "dir="+vmDir("0a0b0c02")+"/tpm"),
		start(qemuBin, "file:"+vmDir("0a0b0c03")+"/console.log"), // no record at all
	}
	others := []<-chan struct{}{
		start(qemuBin, "path=/elsewhere"+vmDir("0a0b0c01")+"/qmp.sock"), // another state directory
		start("/bin/sh", vmDir("0a0b0c01")+"/console.log"),              // not QEMU or swtpm
	}

	log := slog.New(slog.DiscardHandler)
	drv := driver.New(driver.Config{StateDir: dir, QEMUBinary: qemuBin, SwtpmBinary: swtpmBin, KillGrace: time.Second}, log)
	poll.Until(t, "the strays to run under the argv the restore looks for", func() bool {
		found := map[int]bool{}
		for _, ss := range drv.Strays() {
			for _, s := range ss {
				found[s.PID] = true
			}
		}
		for _, done := range strays {
			if !found[pids[done]] {
				return false
			}
		}
		return true
	})
	m := restoreVMs(t, vm.Config{StateDir: dir, KillGrace: time.Second}.WithDefaults(), log, st, drv)
	for i, done := range strays {
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Errorf("stray %d still runs", i)
		}
	}
	for i, done := range others {
		select {
		case <-done:
			t.Errorf("process %d, which is no VM process of this state directory, was ended", i)
		default:
		}
	}
	if rec, _ := m.Get("0a0b0c01"); rec.GetState() != hypervisorv1.State_STATE_FAILED || rec.GetLastError() == "" {
		t.Errorf("record caught in creating: %v", rec)
	}
	if rec, _ := m.Get("0a0b0c02"); rec.GetState() != hypervisorv1.State_STATE_STOPPED || rec.GetLastError() != "vm-manager restarted while the VM was starting; start the VM again" {
		t.Errorf("stopped record whose start was interrupted: %v", rec)
	}
}

// restoreVMs wires the VM core's parts over the real driver as server/ does
// (what a restart's restore needs: no attestation, no network).
func restoreVMs(t *testing.T, cfg vm.Config, log *slog.Logger, st *vmstore.Store, drv *driver.Driver) *vm.Table {
	t.Helper()
	table, err := vm.NewTable(cfg, log, st)
	if err != nil {
		t.Fatal(err)
	}
	activity := vm.NewActivity(cfg, log, table)
	boots := vm.NewBoots(nil, noImages{})
	nets := network.NewRegistry(t.Context(), st, nil, table.AttachedTo, cfg.Limits.MaxNetworks, cfg.Network, log)
	refused := &vm.Refusals{}
	runner := vm.NewRunner(cfg, log, vm.RunnerDeps{Table: table, Driver: drv, Images: noImages{}, Router: notify.NewRouter(), Networks: nets, Activity: activity, Boots: boots})
	access := vm.NewAccess(cfg, log, table, nets, activity, nil, refused)
	m := vm.New(cfg, log, vm.Deps{Store: st, Images: noImages{}, Driver: drv, Table: table, Runner: runner, Activity: activity, Access: access, Networks: nets, Refusals: refused})
	m.RunLoops()
	t.Cleanup(func() {
		m.Close()
		nets.Close()
		_ = table.Close()
	})
	return table
}
