package vm

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/notify"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// A create killed after its lease was written but before its record, or a
// delete killed after the record went, leaves a lease (and a marked
// directory) without a record. The next hypervisor releases and removes
// them; a directory it cannot tell was deleted stays.
func TestSweepDeletedAtStart(t *testing.T) {
	dir := t.TempDir()
	st, err := vmstore.Open(filepath.Join(dir, "hypervisor.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	vmDir := func(id string) string { return filepath.Join(dir, "vms", id) }
	const kept, leaked, deleted, unknown = "0a0b0c01", "0a0b0c02", "0a0b0c03", "0a0b0c04"
	if err := st.PutNetwork(&hypervisorv1.Network{
		Spec: &hypervisorv1.NetworkSpec{Name: "lab", Cidr: "10.9.0.0/24"},
		Leases: []*hypervisorv1.Lease{
			{VmId: kept, Ip: "10.9.0.2"},
			{VmId: leaked, Ip: "10.9.0.3"},
			{VmId: deleted, Ip: "10.9.0.4"},
		},
	}); err != nil {
		t.Fatal(err)
	}
	if err := st.PutVM(&storepb.VirtualMachine{Id: kept, Name: "kept", State: hypervisorv1.State_STATE_STOPPED,
		Network: "lab", Ip: "10.9.0.2", Paths: &hypervisorv1.Paths{Dir: vmDir(kept)}}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{kept, deleted, unknown} {
		if err := os.MkdirAll(vmDir(id), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(vmDir(deleted), sweepMarker), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	// A fork cut short left its snapshot of kept, which goes; kept's own
	// files stay.
	snapshot := filepath.Join(vmDir(kept), forkSnapshotPrefix+"0a0b0cff")
	if err := os.MkdirAll(snapshot, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(snapshot, "state.bin"), []byte("ram"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(vmDir(kept), "disk.raw"), nil, 0o600); err != nil {
		t.Fatal(err)
	}

	m, err := assemble(Config{StateDir: dir}, slog.New(slog.DiscardHandler), st, images2{}, nil, notify.NewRouter(), newFakeDriver())
	if err != nil {
		t.Fatal(err)
	}
	m.RunLoops()
	t.Cleanup(m.Close)

	leases := func() map[string]string {
		rec, err := st.GetNetwork("lab")
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]string{}
		for _, l := range rec.GetLeases() {
			out[l.GetVmId()] = l.GetIp()
		}
		return out
	}
	if got := leases(); len(got) != 1 || got[kept] != "10.9.0.2" {
		t.Errorf("persisted leases after the start = %v, want only %s's", got, kept)
	}
	if got := m.networkLeases("lab"); len(got) != 1 {
		t.Errorf("leases in memory after the start = %v", got)
	}
	for id, want := range map[string]bool{kept: true, deleted: false, unknown: true} {
		if _, err := os.Stat(vmDir(id)); (err == nil) != want {
			t.Errorf("directory of %s exists=%v, want %v", id, err == nil, want)
		}
	}

	if _, err := os.Stat(snapshot); !os.IsNotExist(err) {
		t.Errorf("the fork snapshot left by a crash is still there: %v", err)
	}
	if _, err := os.Stat(filepath.Join(vmDir(kept), "disk.raw")); err != nil {
		t.Errorf("the sweep of fork snapshots took the vm's disk: %v", err)
	}

	// A whole delete leaves none of the three behind.
	if err := m.Delete(context.Background(), kept); err != nil {
		t.Fatal(err)
	}
	if got := leases(); len(got) != 0 {
		t.Errorf("leases after delete = %v", got)
	}
	if _, err := os.Stat(vmDir(kept)); !os.IsNotExist(err) {
		t.Errorf("directory after delete: %v", err)
	}
	if _, err := st.GetVM(kept); err == nil {
		t.Error("record after delete")
	}
}

func (m *testVMs) networkLeases(name string) map[string]string {
	out := map[string]string{}
	for id, ip := range m.nets.Running(name).Leases() {
		out[id] = ip.String()
	}
	return out
}

// A new VM never gets the id of a VM that exists, of a deleted VM whose
// forget is still queued, or of a directory left in place.
func TestFreeIDAvoidsTakenIDs(t *testing.T) {
	m, mc := newTestManager(t, nil)
	if err := m.store.PutVM(mc.rec); err != nil {
		t.Fatal(err)
	}
	if err := m.store.DeleteVM("0d0d0d0d"); err != nil { // queues its forget
		t.Fatal(err)
	}
	if err := os.MkdirAll(m.vmDir("0e0e0e0e"), 0o700); err != nil {
		t.Fatal(err)
	}
	ids := []string{mc.id, "0d0d0d0d", "0e0e0e0e", "0f0f0f0f"}
	m.newID = func() string { id := ids[0]; ids = ids[1:]; return id }
	m.mu.Lock()
	got := m.freeIDLocked()
	m.mu.Unlock()
	if got != "0f0f0f0f" {
		t.Errorf("freeIDLocked = %s, want 0f0f0f0f", got)
	}
}

// In a fleet every id starts with the node's index (Config.IDPrefix), the
// rest random: the fleet gateway routes by it.
func TestIDPrefix(t *testing.T) {
	dir := t.TempDir()
	st, err := vmstore.Open(filepath.Join(dir, "hypervisor.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	m, err := assemble(Config{StateDir: dir, ImageDir: dir, IDPrefix: "02a"}, slog.New(slog.DiscardHandler), st, images2{}, nil, notify.NewRouter(), newFakeDriver())
	if err != nil {
		t.Fatal(err)
	}
	m.RunLoops()
	defer m.Close()
	seen := map[string]bool{}
	for range 20 {
		m.mu.Lock()
		id := m.freeIDLocked()
		m.mu.Unlock()
		if len(id) != 8 || id[:3] != "02a" {
			t.Fatalf("id %q: want 02a and 5 hex characters", id)
		}
		seen[id] = true
	}
	if len(seen) < 2 {
		t.Errorf("ids not random: %v", seen)
	}
}
