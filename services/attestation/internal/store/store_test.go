package store

import (
	"bytes"
	"path/filepath"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/boltdb"
)

// TestMigrationFromVersion1 opens a database written by a version-1 binary
// (policies and vms, nonces in memory): the data stays, nonces work.
func TestMigrationFromVersion1(t *testing.T) {
	path := filepath.Join(t.TempDir(), "attestation.db")
	v1 := boltdb.Schema{Name: Schema.Name, Migrations: Schema.Migrations[:1]}
	db, err := boltdb.Open(path, v1, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	old := &Store{db: db}
	if err := old.PutVM(&VM{ID: "0a0b0c0d", Image: "img_1", AKFingerprint: "ab"}, &attestationv1.Attestation{Boot: 3}); err != nil {
		t.Fatal(err)
	}
	db.Close()

	st, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if name, v, err := boltdb.Version(st.db); err != nil || name != "attestation" || v != Schema.Latest() {
		t.Fatalf("schema %s v%d %v, want attestation v%d", name, v, err, Schema.Latest())
	}
	vm, att, err := st.GetVM("0a0b0c0d")
	if err != nil || vm.AKFingerprint != "ab" || att.GetBoot() != 3 {
		t.Fatalf("vm after migration: %+v %v %v", vm, att, err)
	}
	now := time.Now()
	nonce := bytes.Repeat([]byte{7}, 32)
	if err := st.AddNonce(vm.ID, nonce, Nonce{Boot: 3, Issued: now, Expires: now.Add(time.Minute)}, now, 8); err != nil {
		t.Fatal(err)
	}
	if n, ok, err := st.ConsumeNonce(vm.ID, nonce, now); err != nil || !ok || n.Boot != 3 {
		t.Fatalf("consume: %+v %v %v", n, ok, err)
	}
	if _, ok, _ := st.ConsumeNonce(vm.ID, nonce, now); ok {
		t.Error("a nonce was accepted twice")
	}
}

// TestMigrationMarksFirstUsePins opens a version-2 database: its pinned keys
// were all pinned by a first verified initrd quote, and say so after the
// migration; VMs without a key and every other field stay as they were.
func TestMigrationMarksFirstUsePins(t *testing.T) {
	path := filepath.Join(t.TempDir(), "attestation.db")
	v2 := boltdb.Schema{Name: Schema.Name, Migrations: Schema.Migrations[:2]}
	db, err := boltdb.Open(path, v2, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	old := &Store{db: db}
	if err := old.PutVM(&VM{ID: "0a0b0c0d", Image: "img_1", AKPub: []byte{1}, AKFingerprint: "ab"}, &attestationv1.Attestation{Boot: 3, UserDataReleased: true}); err != nil {
		t.Fatal(err)
	}
	if err := old.PutVM(&VM{ID: "0e0e0e0e", Image: "img_1"}, &attestationv1.Attestation{Boot: 1}); err != nil {
		t.Fatal(err)
	}
	db.Close()

	st, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, v, _ := boltdb.Version(st.db); v != 3 {
		t.Fatalf("version %d, want 3", v)
	}
	vm, att, err := st.GetVM("0a0b0c0d")
	if err != nil || vm.AKOrigin != OriginFirstUse || vm.AKFingerprint != "ab" || string(vm.AKPub) != "\x01" || att.GetBoot() != 3 || !att.GetUserDataReleased() ||
		att.GetAkOrigin() != attestationv1.AkOrigin_AK_ORIGIN_FIRST_USE || att.GetAkFingerprint() != "ab" {
		t.Fatalf("pinned vm after migration: %+v %v %v", vm, att, err)
	}
	vm, att, err = st.GetVM("0e0e0e0e")
	if err != nil || vm.AKOrigin != "" || att.GetAkOrigin() != attestationv1.AkOrigin_AK_ORIGIN_UNSPECIFIED || att.GetBoot() != 1 {
		t.Fatalf("unpinned vm after migration: %+v %v %v", vm, att, err)
	}
}

func TestNonceLimitsAndExpiry(t *testing.T) {
	st, err := Open(filepath.Join(t.TempDir(), "attestation.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	now := time.Now()
	var first []byte
	for i := 0; i < 10; i++ {
		n := bytes.Repeat([]byte{byte(i)}, 32)
		if i == 0 {
			first = n
		}
		at := now.Add(time.Duration(i) * time.Second)
		if err := st.AddNonce("vm", n, Nonce{Issued: at, Expires: at.Add(5 * time.Minute)}, at, 8); err != nil {
			t.Fatal(err)
		}
	}
	if c := st.NonceCount("vm"); c != 8 {
		t.Errorf("%d outstanding, want at most 8", c)
	}
	if _, ok, _ := st.ConsumeNonce("vm", first, now); ok {
		t.Error("the oldest nonce should have been dropped")
	}
	last := bytes.Repeat([]byte{9}, 32)
	if _, ok, _ := st.ConsumeNonce("vm", last, now.Add(10*time.Minute)); ok {
		t.Error("an expired nonce was accepted")
	}
	if err := st.DeleteVM("vm"); err != nil {
		t.Fatal(err)
	}
	if c := st.NonceCount("vm"); c != 0 {
		t.Errorf("forgetting the vm left %d nonces", c)
	}
}
