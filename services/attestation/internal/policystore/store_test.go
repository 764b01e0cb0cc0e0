package policystore

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/boltdb"
	bolt "go.etcd.io/bbolt"
)

// TestMigrationFromVersion1 opens a database written by a version-1 binary
// (policies and vms, nonces in memory): the data stays, a nonce key is made.
func TestMigrationFromVersion1(t *testing.T) {
	path := filepath.Join(t.TempDir(), "attestation.db")
	v1 := boltdb.Schema{Name: Schema.Name, Migrations: Schema.Migrations[:1]}
	db, err := boltdb.Open(path, v1, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	old := newStore(db)
	if err := old.PutVM(&VM{ID: "0a0b0c0d", Image: "img_1", AKFingerprint: "ab"}, &attestationv1.Attestation{Boot: 3}); err != nil {
		t.Fatal(err)
	}
	old.Close()

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
	if key, err := st.NonceKey(); err != nil || len(key) != 32 {
		t.Fatalf("nonce key: %x %v", key, err)
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
	old := newStore(db)
	if err := old.PutVM(&VM{ID: "0a0b0c0d", Image: "img_1", AKPub: []byte{1}, AKFingerprint: "ab"}, &attestationv1.Attestation{Boot: 3, UserDataReleased: true}); err != nil {
		t.Fatal(err)
	}
	if err := old.PutVM(&VM{ID: "0e0e0e0e", Image: "img_1"}, &attestationv1.Attestation{Boot: 1}); err != nil {
		t.Fatal(err)
	}
	old.Close()

	st, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, v, _ := boltdb.Version(st.db); v != Schema.Latest() {
		t.Fatalf("version %d, want %d", v, Schema.Latest())
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

// TestMigrationDropsNonces opens a version-3 database the previous binary
// wrote (testdata/attestation-v3.db, made by the store of commit 8d689ed: a
// policy, a VM with a verified boot, golden events and two outstanding
// nonces): the nonces bucket goes, a nonce key comes, everything else stays,
// and the key is the same at the next open.
func TestMigrationDropsNonces(t *testing.T) {
	raw, err := os.ReadFile("testdata/attestation-v3.db")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "attestation.db")
	if err := os.WriteFile(path, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	var before int
	_ = db.View(func(tx *bolt.Tx) error {
		if b := tx.Bucket(bucketNonces); b != nil {
			before = b.Bucket([]byte("0a0b0c0d")).Stats().KeyN
		}
		return nil
	})
	_, v, _ := boltdb.Version(db)
	db.Close()
	if v != 3 || before != 2 {
		t.Fatalf("fixture: version %d with %d nonces, want version 3 with 2", v, before)
	}

	st, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, v, _ := boltdb.Version(st.db); v != 4 {
		t.Fatalf("version %d, want 4", v)
	}
	_ = st.db.View(func(tx *bolt.Tx) error {
		if tx.Bucket(bucketNonces) != nil {
			t.Error("the nonces bucket survived the migration")
		}
		for err := range tx.Check() {
			t.Errorf("bbolt check: %v", err)
		}
		return nil
	})
	vm, att, err := st.GetVM("0a0b0c0d")
	if err != nil || vm.AKFingerprint != "sha256:ab" || vm.AKOrigin != OriginHost || att.GetBoot() != 3 || !att.GetUserDataReleased() || !att.GetInitrd().GetVerified() {
		t.Fatalf("vm after migration: %+v %v %v", vm, att, err)
	}
	if p, err := st.GetPolicy("img_1"); err != nil || len(p.GetGoldenPcrs()) != 1 {
		t.Fatalf("policy after migration: %v %v", p, err)
	}
	if ev, err := st.GoldenEvents("img_1"); err != nil || len(ev) != 1 {
		t.Fatalf("golden events after migration: %v %v", ev, err)
	}
	key, err := st.NonceKey()
	if err != nil || len(key) != 32 {
		t.Fatalf("nonce key: %x %v", key, err)
	}
	if err := st.DeleteVM("0a0b0c0d"); err != nil {
		t.Fatal(err)
	}
	st.Close()
	st, err = Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if again, err := st.NonceKey(); err != nil || !bytes.Equal(again, key) {
		t.Errorf("the nonce key changed across opens: %x, was %x (%v)", again, key, err)
	}
}
