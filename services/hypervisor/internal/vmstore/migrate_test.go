package vmstore_test

import (
	"bytes"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/boltdb"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// v3Record is a VM record as schema 3 wrote it: the public VirtualMachine,
// whose Process then had start_ticks (2) and whose TpmIdentity kept the raw
// keys (9, 10) next to their PEM and hex forms. Those fields are gone from
// the public message, so they are written by hand.
func v3Record(t *testing.T) []byte {
	t.Helper()
	raw, err := proto.Marshal(&hypervisorv1.VirtualMachine{Id: "0a1b2c3d", Name: "web", State: hypervisorv1.State_STATE_READY, Cpus: 2})
	if err != nil {
		t.Fatal(err)
	}
	msg := func(fields ...[]byte) []byte { return bytes.Join(fields, nil) }
	varint := func(n protowire.Number, v uint64) []byte {
		return protowire.AppendVarint(protowire.AppendTag(nil, n, protowire.VarintType), v)
	}
	lendel := func(n protowire.Number, b []byte) []byte {
		return protowire.AppendBytes(protowire.AppendTag(nil, n, protowire.BytesType), b)
	}
	process := msg(varint(1, 4242), varint(2, 987654), lendel(3, []byte("")))
	processes := msg(lendel(1, process), lendel(2, msg(varint(1, 4243), varint(2, 987600))))
	identity := msg(lendel(1, []byte("-----BEGIN PUBLIC KEY-----")), lendel(5, []byte("abcd")), lendel(9, []byte{0, 0x23, 1}), lendel(10, []byte{0, 1, 2}))
	return msg(raw, lendel(32, processes), lendel(35, identity), varint(36, 3))
}

// TestMigrationToStoredRecords opens a schema-3 database: its VM records
// come back as stored records with the process handles and raw keys they
// had, and without the derived PEM and hex forms.
func TestMigrationToStoredRecords(t *testing.T) {
	path := tempDB(t)
	v3 := boltdb.Schema{Name: "hypervisor", Migrations: vmstore.Schema.Migrations[:3]}
	db, err := boltdb.Open(path, v3, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Update(func(tx *bolt.Tx) error { return tx.Bucket([]byte("vms")).Put([]byte("0a1b2c3d"), v3Record(t)) }); err != nil {
		t.Fatal(err)
	}
	db.Close()

	st := open(t, path)
	vm, err := st.GetVM("0a1b2c3d")
	if err != nil {
		t.Fatal(err)
	}
	p := vm.GetProcesses()
	if vm.GetName() != "web" || vm.GetCpus() != 2 || vm.GetState() != hypervisorv1.State_STATE_READY || vm.GetBootCount() != 3 ||
		p.GetQemu().GetPid() != 4242 || p.GetQemu().GetStartTicks() != 987654 || p.GetTpm().GetStartTicks() != 987600 {
		t.Fatalf("record after migration: %v", vm)
	}
	if !bytes.Equal(vm.GetTpm().GetAkPublic(), []byte{0, 0x23, 1}) || !bytes.Equal(vm.GetTpm().GetEkPublic(), []byte{0, 1, 2}) {
		t.Errorf("raw keys lost: %v", vm.GetTpm())
	}
	if u := vm.GetTpm().ProtoReflect().GetUnknown(); len(u) != 0 {
		t.Errorf("the derived PEM and hex forms are still stored: %q", u)
	}
	st.Close()
	if _, v := version(t, path); v != vmstore.Schema.Latest() {
		t.Errorf("version %d, want %d", v, vmstore.Schema.Latest())
	}
}

// TestMigrationAddsPools opens a schema-5 database with a VM: the VM is
// kept and pools can be stored and listed after the migration.
func TestMigrationAddsPools(t *testing.T) {
	path := tempDB(t)
	v5 := boltdb.Schema{Name: "hypervisor", Migrations: vmstore.Schema.Migrations[:5]}
	db, err := boltdb.Open(path, v5, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := proto.Marshal(&storepb.VirtualMachine{Id: "0a1b2c3d", Name: "web"})
	if err := db.Update(func(tx *bolt.Tx) error { return tx.Bucket([]byte("vms")).Put([]byte("0a1b2c3d"), raw) }); err != nil {
		t.Fatal(err)
	}
	db.Close()

	st := open(t, path)
	if vm, err := st.GetVM("0a1b2c3d"); err != nil || vm.GetName() != "web" {
		t.Fatalf("vm after migration: %v, %v", vm, err)
	}
	if err := st.PutPool(&storepb.Pool{Name: "small", Size: 2, Shape: &hypervisorv1.PoolShape{Cpus: 1}}); err != nil {
		t.Fatal(err)
	}
	pools, err := st.ListPools()
	if err != nil || len(pools) != 1 || pools[0].GetSize() != 2 || pools[0].GetShape().GetCpus() != 1 {
		t.Fatalf("pools: %v, %v", pools, err)
	}
	if err := st.DeletePool("small"); err != nil {
		t.Fatal(err)
	}
	if pools, _ := st.ListPools(); len(pools) != 0 {
		t.Errorf("pool left after delete: %v", pools)
	}
	st.Close()
	if _, v := version(t, path); v != vmstore.Schema.Latest() || v != 6 {
		t.Errorf("version %d, want %d (6)", v, vmstore.Schema.Latest())
	}
}
