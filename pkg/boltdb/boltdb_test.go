package boltdb_test

import (
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/pkg/boltdb"
	bolt "go.etcd.io/bbolt"
)

const lockTimeout = 200 * time.Millisecond

var (
	dataBucket  = []byte("data")
	countBucket = []byte("counts")
)

// bump increments counts/<key>, so a test can see how often a migration ran.
func bump(tx *bolt.Tx, key string) error {
	b, err := tx.CreateBucketIfNotExists(countBucket)
	if err != nil {
		return err
	}
	var n uint64
	if v := b.Get([]byte(key)); v != nil {
		n = binary.BigEndian.Uint64(v)
	}
	return b.Put([]byte(key), binary.BigEndian.AppendUint64(nil, n+1))
}

func count(t *testing.T, db *bolt.DB, key string) uint64 {
	t.Helper()
	var n uint64
	if err := db.View(func(tx *bolt.Tx) error {
		if b := tx.Bucket(countBucket); b != nil {
			if v := b.Get([]byte(key)); v != nil {
				n = binary.BigEndian.Uint64(v)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return n
}

func m1() boltdb.Migration {
	return boltdb.Migration{Version: 1, Description: "create data", Apply: func(tx *bolt.Tx) error {
		if _, err := tx.CreateBucket(dataBucket); err != nil {
			return err
		}
		return bump(tx, "m1")
	}}
}

func m2() boltdb.Migration {
	return boltdb.Migration{Version: 2, Description: "add index", Apply: func(tx *bolt.Tx) error {
		if _, err := tx.CreateBucket([]byte("index")); err != nil {
			return err
		}
		return bump(tx, "m2")
	}}
}

func m3() boltdb.Migration {
	return boltdb.Migration{Version: 3, Description: "three", Apply: func(tx *bolt.Tx) error { return bump(tx, "m3") }}
}

func open(t *testing.T, path string, s boltdb.Schema) *bolt.DB {
	t.Helper()
	db, err := boltdb.Open(path, s, lockTimeout)
	if err != nil {
		t.Fatalf("Open(%s, %s v%d): %v", path, s.Name, s.Latest(), err)
	}
	return db
}

func checkVersion(t *testing.T, db *bolt.DB, name string, version int) {
	t.Helper()
	n, v, err := boltdb.Version(db)
	if err != nil {
		t.Fatalf("Version: %v", err)
	}
	if n != name || v != version {
		t.Fatalf("Version = (%q, %d), want (%q, %d)", n, v, name, version)
	}
}

func TestLatest(t *testing.T) {
	if got := (boltdb.Schema{}).Latest(); got != 0 {
		t.Errorf("empty Latest = %d", got)
	}
	if got := (boltdb.Schema{Migrations: []boltdb.Migration{m1(), m2(), m3()}}).Latest(); got != 3 {
		t.Errorf("Latest = %d, want 3", got)
	}
}

func TestFreshOpenAppliesEveryMigration(t *testing.T) {
	path := filepath.Join(t.TempDir(), "fresh.db")
	db := open(t, path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1(), m2(), m3()}})
	defer db.Close()
	checkVersion(t, db, "svc", 3)
	for _, k := range []string{"m1", "m2", "m3"} {
		if n := count(t, db, k); n != 1 {
			t.Errorf("%s ran %d times, want 1", k, n)
		}
	}
	if err := db.View(func(tx *bolt.Tx) error {
		if tx.Bucket(dataBucket) == nil || tx.Bucket([]byte("index")) == nil {
			return errors.New("migration buckets missing")
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Errorf("file mode = %o, want 600", fi.Mode().Perm())
	}
}

func TestMigrationPath(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.db")
	v1 := boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1()}}
	v2 := boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1(), m2()}}

	db := open(t, path, v1)
	checkVersion(t, db, "svc", 1)
	if err := db.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(dataBucket).Put([]byte("vm1"), []byte("record"))
	}); err != nil {
		t.Fatal(err)
	}
	if n := count(t, db, "m2"); n != 0 {
		t.Fatalf("m2 ran on a v1 schema")
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}

	db = open(t, path, v2)
	checkVersion(t, db, "svc", 2)
	if n := count(t, db, "m1"); n != 1 {
		t.Errorf("m1 ran %d times, want 1", n)
	}
	if n := count(t, db, "m2"); n != 1 {
		t.Errorf("m2 ran %d times, want 1", n)
	}
	var got []byte
	_ = db.View(func(tx *bolt.Tx) error {
		got = append([]byte(nil), tx.Bucket(dataBucket).Get([]byte("vm1"))...)
		return nil
	})
	if string(got) != "record" {
		t.Errorf("v1 key after migration = %q", got)
	}
	db.Close()

	db = open(t, path, v2)
	defer db.Close()
	checkVersion(t, db, "svc", 2)
	if n := count(t, db, "m2"); n != 1 {
		t.Errorf("m2 ran %d times after a second open, want 1", n)
	}
	if n := count(t, db, "m1"); n != 1 {
		t.Errorf("m1 ran %d times after a second open, want 1", n)
	}
}

func TestTooNewIsRefused(t *testing.T) {
	path := filepath.Join(t.TempDir(), "new.db")
	db := open(t, path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1(), m2(), m3()}})
	db.Close()

	_, err := boltdb.Open(path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1(), m2()}}, lockTimeout)
	if !errors.Is(err, boltdb.ErrTooNew) {
		t.Fatalf("err = %v, want ErrTooNew", err)
	}
	if !strings.Contains(err.Error(), "version 3") || !strings.Contains(err.Error(), "up to 2") {
		t.Errorf("err = %q, want versions named", err)
	}
	// Not downgraded: the newer binary still sees version 3, and the refusing
	// Open released the file.
	db = open(t, path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1(), m2(), m3()}})
	defer db.Close()
	checkVersion(t, db, "svc", 3)
	if n := count(t, db, "m3"); n != 1 {
		t.Errorf("m3 ran %d times", n)
	}
}

func TestOtherSchemaIsRefused(t *testing.T) {
	path := filepath.Join(t.TempDir(), "a.db")
	db := open(t, path, boltdb.Schema{Name: "a", Migrations: []boltdb.Migration{m1()}})
	db.Close()

	_, err := boltdb.Open(path, boltdb.Schema{Name: "b", Migrations: []boltdb.Migration{m1(), m2()}}, lockTimeout)
	if err == nil {
		t.Fatal("schema b opened a's file")
	}
	if !strings.Contains(err.Error(), `"a"`) || !strings.Contains(err.Error(), `"b"`) {
		t.Errorf("err = %q, want both schema names", err)
	}
	db = open(t, path, boltdb.Schema{Name: "a", Migrations: []boltdb.Migration{m1()}})
	defer db.Close()
	checkVersion(t, db, "a", 1)
	if n := count(t, db, "m2"); n != 0 {
		t.Errorf("b's migration ran on a's file")
	}
}

func TestFailingMigrationKeepsPreviousVersion(t *testing.T) {
	path := filepath.Join(t.TempDir(), "fail.db")
	db := open(t, path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1()}})
	db.Close()

	boom := errors.New("boom")
	bad := boltdb.Migration{Version: 2, Description: "explodes", Apply: func(tx *bolt.Tx) error {
		if err := bump(tx, "m2"); err != nil { // must be rolled back
			return err
		}
		if _, err := tx.CreateBucket([]byte("half")); err != nil {
			return err
		}
		return boom
	}}
	_, err := boltdb.Open(path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1(), bad, m3()}}, lockTimeout)
	if !errors.Is(err, boom) {
		t.Fatalf("err = %v, want the migration's error", err)
	}
	if !strings.Contains(err.Error(), "version 2") || !strings.Contains(err.Error(), "explodes") {
		t.Errorf("err = %q, want version and description", err)
	}

	// The file is usable and still at version 1 with nothing of the failed step.
	db = open(t, path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1()}})
	checkVersion(t, db, "svc", 1)
	if n := count(t, db, "m2"); n != 0 {
		t.Errorf("failed migration's write survived (count %d)", n)
	}
	_ = db.View(func(tx *bolt.Tx) error {
		if tx.Bucket([]byte("half")) != nil {
			t.Error("failed migration's bucket survived")
		}
		return nil
	})
	db.Close()

	// A fixed binary migrates it normally.
	db = open(t, path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1(), m2(), m3()}})
	defer db.Close()
	checkVersion(t, db, "svc", 3)
	if n := count(t, db, "m2"); n != 1 {
		t.Errorf("m2 ran %d times", n)
	}
}

func TestFailingLaterMigrationKeepsEarlierOnes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "partial.db")
	bad := boltdb.Migration{Version: 3, Description: "bad", Apply: func(*bolt.Tx) error { return errors.New("nope") }}
	if _, err := boltdb.Open(path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1(), m2(), bad}}, lockTimeout); err == nil {
		t.Fatal("Open succeeded despite a failing migration")
	}
	db := open(t, path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1(), m2()}})
	defer db.Close()
	checkVersion(t, db, "svc", 2)
	if count(t, db, "m1") != 1 || count(t, db, "m2") != 1 {
		t.Errorf("m1/m2 counts = %d/%d", count(t, db, "m1"), count(t, db, "m2"))
	}
}

func TestSecondOpenTimesOut(t *testing.T) {
	path := filepath.Join(t.TempDir(), "locked.db")
	s := boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1()}}
	db := open(t, path, s)

	start := time.Now()
	_, err := boltdb.Open(path, s, lockTimeout)
	elapsed := time.Since(start)
	if err == nil {
		t.Fatal("second Open of a held file succeeded")
	}
	if !strings.Contains(err.Error(), "another process") {
		t.Errorf("err = %q, want it to mention another process", err)
	}
	if elapsed < lockTimeout/2 || elapsed > 5*time.Second {
		t.Errorf("second Open took %v with lock timeout %v", elapsed, lockTimeout)
	}

	db.Close()
	db = open(t, path, s)
	db.Close()
}

func TestNonConsecutiveMigrationsRejected(t *testing.T) {
	dir := t.TempDir()
	cases := map[string][]boltdb.Migration{
		"gap":         {m1(), m3()},
		"zero-based":  {{Version: 0, Apply: func(*bolt.Tx) error { return nil }}, m1()},
		"starts-at-2": {m2(), m3()},
		"duplicate":   {m1(), m1()},
	}
	for name, ms := range cases {
		path := filepath.Join(dir, name+".db")
		_, err := boltdb.Open(path, boltdb.Schema{Name: "svc", Migrations: ms}, lockTimeout)
		if err == nil {
			t.Errorf("%s: accepted", name)
			continue
		}
		if !strings.Contains(err.Error(), "schema svc: migration") {
			t.Errorf("%s: err = %q", name, err)
		}
		if _, serr := os.Stat(path); !os.IsNotExist(serr) {
			t.Errorf("%s: file created despite a bad schema", name)
		}
	}
}

func TestVersionOfForeignFile(t *testing.T) {
	// A bbolt file without a meta bucket reads as ("", 0).
	path := filepath.Join(t.TempDir(), "raw.db")
	raw, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	n, v, err := boltdb.Version(raw)
	if err != nil || n != "" || v != 0 {
		t.Errorf("Version(raw) = %q %d %v", n, v, err)
	}
	// A garbage version is an error, not version 0.
	if err := raw.Update(func(tx *bolt.Tx) error {
		b, err := tx.CreateBucket([]byte("meta"))
		if err != nil {
			return err
		}
		return b.Put([]byte("version"), []byte("two"))
	}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := boltdb.Version(raw); err == nil || !strings.Contains(err.Error(), `meta/version "two"`) {
		t.Errorf("Version(garbage) err = %v", err)
	}
	raw.Close()
	if _, err := boltdb.Open(path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1()}}, lockTimeout); err == nil {
		t.Error("Open accepted a garbage version")
	}
}

func TestNegativeVersionIsAnErrorNotAPanic(t *testing.T) {
	path := filepath.Join(t.TempDir(), "neg.db")
	raw, err := bolt.Open(path, 0o600, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := raw.Update(func(tx *bolt.Tx) error {
		b, err := tx.CreateBucket([]byte("meta"))
		if err != nil {
			return err
		}
		if err := b.Put([]byte("schema"), []byte("svc")); err != nil {
			return err
		}
		return b.Put([]byte("version"), []byte("-1"))
	}); err != nil {
		t.Fatal(err)
	}
	raw.Close()
	_, err = boltdb.Open(path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1()}}, lockTimeout)
	if err == nil || !strings.Contains(err.Error(), `meta/version "-1"`) {
		t.Fatalf("err = %v, want a meta/version error", err)
	}
}

func TestCreateBuckets(t *testing.T) {
	path := filepath.Join(t.TempDir(), "db")
	s := boltdb.Schema{Name: "test", Migrations: []boltdb.Migration{
		{Version: 1, Description: "a and b", Apply: boltdb.CreateBuckets([]byte("a"), []byte("b"))},
	}}
	db := open(t, path, s)
	if err := db.Update(func(tx *bolt.Tx) error { return tx.Bucket([]byte("b")).Put([]byte("k"), []byte("v")) }); err != nil {
		t.Fatal(err)
	}
	db.Close()

	// A later migration naming an existing bucket leaves it and its keys alone.
	s.Migrations = append(s.Migrations, boltdb.Migration{Version: 2, Description: "b and c", Apply: boltdb.CreateBuckets([]byte("b"), []byte("c"))})
	db = open(t, path, s)
	defer db.Close()
	checkVersion(t, db, "test", 2)
	if err := db.View(func(tx *bolt.Tx) error {
		for _, name := range []string{"a", "b", "c"} {
			if tx.Bucket([]byte(name)) == nil {
				t.Errorf("bucket %s missing", name)
			}
		}
		if b := tx.Bucket([]byte("b")); b != nil && string(b.Get([]byte("k"))) != "v" {
			t.Errorf("b/k = %q after the second migration, want v", b.Get([]byte("k")))
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}
