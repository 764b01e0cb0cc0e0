package vmstore_test

import (
	"errors"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/boltdb"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	bolt "go.etcd.io/bbolt"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
)

func tempDB(t *testing.T) string { return filepath.Join(t.TempDir(), "hypervisor.db") }

func open(t *testing.T, path string) *vmstore.Store {
	t.Helper()
	st, err := vmstore.Open(path)
	if err != nil {
		t.Fatalf("vmstore.Open: %v", err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// version reads the schema of a closed store file without migrating it.
func version(t *testing.T, path string) (string, int) {
	t.Helper()
	db, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	name, v, err := boltdb.Version(db)
	if err != nil {
		t.Fatal(err)
	}
	return name, v
}

func TestSchema(t *testing.T) {
	if vmstore.Schema.Name != "hypervisor" || vmstore.Schema.Latest() != 6 || len(vmstore.Schema.Migrations) != 6 {
		t.Fatalf("schema = %s v%d (%d migrations)", vmstore.Schema.Name, vmstore.Schema.Latest(), len(vmstore.Schema.Migrations))
	}
}

func TestFreshOpenIsLatest(t *testing.T) {
	path := tempDB(t)
	st, err := vmstore.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	if name, v := version(t, path); name != "hypervisor" || v != 6 {
		t.Errorf("Version = (%q, %d), want (hypervisor, 6)", name, v)
	}
	// Every bucket exists.
	db, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	_ = db.View(func(tx *bolt.Tx) error {
		for _, b := range []string{"meta", "vms", "networks", "policy-sync", "attestation-forget", "watch", "pools"} {
			if tx.Bucket([]byte(b)) == nil {
				t.Errorf("bucket %s missing", b)
			}
		}
		return nil
	})
}

func TestMigrationFromVersion1(t *testing.T) {
	path := tempDB(t)
	v1 := boltdb.Schema{Name: "hypervisor", Migrations: vmstore.Schema.Migrations[:1]}
	db, err := boltdb.Open(path, v1, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	created := time.Date(2025, 2, 3, 4, 5, 6, 0, time.UTC)
	want := &hypervisorv1.VirtualMachine{
		Id:        "0a1b2c3d",
		Name:      "web",
		Image:     "flatcar_4230.2.0",
		MemoryMib: 2048,
		State:     hypervisorv1.State_STATE_STOPPED,
		Metadata:  map[string]string{"role": "worker"},
		CreatedAt: timestamppb.New(created),
	}
	raw, err := proto.Marshal(want)
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Update(func(tx *bolt.Tx) error {
		if tx.Bucket([]byte("policy-sync")) != nil {
			t.Error("v1 already has policy-sync")
		}
		return tx.Bucket([]byte("vms")).Put([]byte(want.GetId()), raw)
	}); err != nil {
		t.Fatal(err)
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	if name, v := version(t, path); name != "hypervisor" || v != 1 {
		t.Fatalf("before migration: (%q, %d)", name, v)
	}

	st, err := vmstore.Open(path)
	if err != nil {
		t.Fatalf("vmstore.Open of a v1 file: %v", err)
	}
	got, err := st.GetVM("0a1b2c3d")
	if err != nil {
		t.Fatalf("GetVM after migration: %v", err)
	}
	if got.GetId() != want.GetId() || got.GetName() != want.GetName() || got.GetImage() != want.GetImage() || got.GetMemoryMib() != 2048 ||
		got.GetState() != want.GetState() || got.GetMetadata()["role"] != "worker" || !got.GetCreatedAt().AsTime().Equal(created) {
		t.Errorf("GetVM = %v\nwant %v", got, want)
	}
	if r, err := st.WatchRevision(); err != nil || r != 0 {
		t.Errorf("WatchRevision after migration = %d %v", r, err)
	}
	if d, err := st.PolicySynced("flatcar_4230.2.0"); err != nil || d != "" {
		t.Errorf("PolicySynced on a fresh bucket = %q %v", d, err)
	}
	if err := st.SetPolicySynced("flatcar_4230.2.0", "abc123"); err != nil {
		t.Fatalf("SetPolicySynced: %v", err)
	}
	if d, err := st.PolicySynced("flatcar_4230.2.0"); err != nil || d != "abc123" {
		t.Errorf("PolicySynced = %q %v", d, err)
	}
	st.Close()
	if name, v := version(t, path); name != "hypervisor" || v != vmstore.Schema.Latest() {
		t.Errorf("after migration: (%q, %d), want (hypervisor, %d)", name, v, vmstore.Schema.Latest())
	}

	// The migrated file opens again with everything in place.
	st = open(t, path)
	if d, _ := st.PolicySynced("flatcar_4230.2.0"); d != "abc123" {
		t.Errorf("PolicySynced after reopen = %q", d)
	}
	if vms, err := st.ListVMs(); err != nil || len(vms) != 1 || !proto.Equal(vms[0], got) {
		t.Errorf("ListVMs after reopen = %v %v", vms, err)
	}
}

func TestRefusesOtherSchemaAndNewer(t *testing.T) {
	path := tempDB(t)
	db, err := boltdb.Open(path, boltdb.Schema{Name: "attestation", Migrations: vmstore.Schema.Migrations[:1]}, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	db.Close()
	if st, err := vmstore.Open(path); err == nil {
		st.Close()
		t.Error("hypervisor store opened an attestation file")
	}

	path = tempDB(t)
	newer := append(append([]boltdb.Migration(nil), vmstore.Schema.Migrations...), boltdb.Migration{Version: vmstore.Schema.Latest() + 1, Apply: func(*bolt.Tx) error { return nil }})
	db, err = boltdb.Open(path, boltdb.Schema{Name: "hypervisor", Migrations: newer}, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	db.Close()
	st, err := vmstore.Open(path)
	if err == nil {
		st.Close()
	}
	if !errors.Is(err, boltdb.ErrTooNew) {
		t.Errorf("err = %v, want ErrTooNew", err)
	}
}

func TestVMs(t *testing.T) {
	st := open(t, tempDB(t))
	if vms, err := st.ListVMs(); err != nil || len(vms) != 0 {
		t.Fatalf("empty ListVMs = %v %v", vms, err)
	}
	_, err := st.GetVM("deadbeef")
	if apierr.CodeOf(err) != apierr.NotFound || !errors.Is(err, apierr.ErrNotFound) {
		t.Errorf("GetVM missing: %v (code %q)", err, apierr.CodeOf(err))
	}

	t0 := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	put := func(id string, created time.Time, name string) {
		t.Helper()
		vm := &storepb.VirtualMachine{Id: id, Name: name}
		if !created.IsZero() {
			vm.CreatedAt = timestamppb.New(created)
		}
		if err := st.PutVM(vm); err != nil {
			t.Fatal(err)
		}
	}
	// Key order (id) differs from creation order on purpose.
	put("000000ff", t0.Add(time.Hour), "c")
	put("00000001", t0.Add(2*time.Hour), "d")
	put("000000bb", t0, "b")
	put("000000aa", t0, "a")
	put("0000000e", t0.Add(time.Nanosecond), "a2")

	vms, err := st.ListVMs()
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, vm := range vms {
		ids = append(ids, vm.GetId())
	}
	if want := []string{"000000aa", "000000bb", "0000000e", "000000ff", "00000001"}; !reflect.DeepEqual(ids, want) {
		t.Errorf("ListVMs order = %v, want %v", ids, want)
	}

	// PutVM replaces a record.
	put("000000aa", t0.Add(3*time.Hour), "a-renamed")
	got, err := st.GetVM("000000aa")
	if err != nil || got.GetName() != "a-renamed" {
		t.Errorf("GetVM after replace = %v %v", got, err)
	}
	vms, _ = st.ListVMs()
	if len(vms) != 5 || vms[4].GetId() != "000000aa" {
		t.Errorf("after replace last = %v (len %d)", vms[len(vms)-1].GetId(), len(vms))
	}
}

func TestNetworks(t *testing.T) {
	path := tempDB(t)
	st, err := vmstore.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	_, err = st.GetNetwork("default")
	if apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("GetNetwork missing: %v", err)
	}
	if ns, err := st.ListNetworks(); err != nil || len(ns) != 0 {
		t.Errorf("empty ListNetworks = %v %v", ns, err)
	}
	st.Close()

	// The store has no network writer of its own yet; write records the way
	// the layout documents them (networks/<name>, protobuf binary).
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"zeta", "default", "lab"} {
		raw, _ := proto.Marshal(&hypervisorv1.Network{Spec: &hypervisorv1.NetworkSpec{Name: name, Cidr: "10.0.0.0/24"}, Gateway: "10.0.0.1"})
		if err := db.Update(func(tx *bolt.Tx) error { return tx.Bucket([]byte("networks")).Put([]byte(name), raw) }); err != nil {
			t.Fatal(err)
		}
	}
	db.Close()

	st = open(t, path)
	n, err := st.GetNetwork("lab")
	if err != nil || n.GetSpec().GetName() != "lab" || n.GetGateway() != "10.0.0.1" {
		t.Errorf("GetNetwork(lab) = %v %v", n, err)
	}
	ns, err := st.ListNetworks()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, n := range ns {
		names = append(names, n.GetSpec().GetName())
	}
	if want := []string{"default", "lab", "zeta"}; !reflect.DeepEqual(names, want) {
		t.Errorf("ListNetworks = %v, want %v", names, want)
	}
}

func TestCorruptRecordIsAnError(t *testing.T) {
	path := tempDB(t)
	st, err := vmstore.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.PutVM(&storepb.VirtualMachine{Id: "00000001"}); err != nil {
		t.Fatal(err)
	}
	st.Close()
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket([]byte("vms")).Put([]byte("00000002"), []byte{0xff, 0xff, 0xff})
	}); err != nil {
		t.Fatal(err)
	}
	db.Close()
	st = open(t, path)
	if _, err := st.GetVM("00000002"); err == nil {
		t.Error("GetVM of a corrupt record succeeded")
	}
	if _, err := st.ListVMs(); err == nil {
		t.Error("ListVMs with a corrupt record succeeded")
	}
	if vm, err := st.GetVM("00000001"); err != nil || vm.GetId() != "00000001" {
		t.Errorf("intact record: %v %v", vm, err)
	}
}

func TestSecondOpenRefused(t *testing.T) {
	path := tempDB(t)
	open(t, path)
	if st, err := vmstore.Open(path); err == nil {
		st.Close()
		t.Fatal("second vmstore.Open of a held file succeeded")
	}
}

// A deleted VM stays queued for attestation to forget until Forgotten, across
// a reopen (the fault suite found VMs deleted while attestation was down
// keeping their AK pin there).
func TestDeleteVMQueuesForget(t *testing.T) {
	path := tempDB(t)
	st, err := vmstore.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{"0a0b0c01", "0a0b0c02"} {
		if err := st.PutVM(&storepb.VirtualMachine{Id: id}); err != nil {
			t.Fatal(err)
		}
	}
	if ids, err := st.PendingForgets(); err != nil || len(ids) != 0 {
		t.Fatalf("PendingForgets before a delete = %v, %v", ids, err)
	}
	for _, id := range []string{"0a0b0c01", "0a0b0c02"} {
		if err := st.DeleteVM(id); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.Forgotten("0a0b0c01"); err != nil {
		t.Fatal(err)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
	st = open(t, path)
	if ids, err := st.PendingForgets(); err != nil || !reflect.DeepEqual(ids, []string{"0a0b0c02"}) {
		t.Errorf("PendingForgets after a reopen = %v, %v", ids, err)
	}
	if _, err := st.GetVM("0a0b0c02"); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("GetVM of a deleted VM: %v", err)
	}
}

// The watch's revision ceiling is 0 in a fresh database and survives a reopen.
func TestWatchRevision(t *testing.T) {
	path := tempDB(t)
	st := open(t, path)
	if r, err := st.WatchRevision(); r != 0 || err != nil {
		t.Fatalf("fresh: %d %v", r, err)
	}
	if err := st.SetWatchRevision(1<<40 + 7); err != nil {
		t.Fatal(err)
	}
	st.Close()
	st = open(t, path)
	if r, err := st.WatchRevision(); r != 1<<40+7 || err != nil {
		t.Errorf("after reopen: %d %v", r, err)
	}
}
