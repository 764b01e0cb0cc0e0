package boltdb_test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/pkg/boltdb"
	bolt "go.etcd.io/bbolt"
)

// filled writes a database with n records and returns its path and bytes.
func filled(t *testing.T, n int) (string, []byte) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "svc.db")
	db := open(t, path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1()}})
	for i := 0; i < n; i += 50 { // a few transactions, so both meta pages are in use
		if err := db.Update(func(tx *bolt.Tx) error {
			for j := i; j < min(i+50, n); j++ {
				if err := tx.Bucket(dataBucket).Put(fmt.Appendf(nil, "k%04d", j), bytes.Repeat([]byte{byte(j)}, 700)); err != nil {
					return err
				}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	if err := db.Close(); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return path, b
}

func flip(b []byte, offs ...int) []byte {
	out := bytes.Clone(b)
	for _, o := range offs {
		out[o] ^= 0xff
	}
	return out
}

// TestDamagedFileIsRefusedUntouched: issue 8's database faults. Before the
// check, a damaged newest meta page made bbolt roll back one committed
// transaction without a word (and overwrite the file with its next commit),
// and a file truncated to half panicked in bbolt's freelist loader.
func TestDamagedFileIsRefusedUntouched(t *testing.T) {
	path, orig := filled(t, 300)
	page := os.Getpagesize()
	garbage := make([]byte, len(orig))
	for i := range garbage {
		garbage[i] = byte(i*7 + 3)
	}
	for _, tc := range []struct {
		name string
		data []byte
		want string
	}{
		{"truncated to half", orig[:len(orig)/2], "truncated?"},
		{"truncated to two pages", orig[:2*page], "truncated?"},
		{"meta 0 checksum", flip(orig, 16+40), "meta page 0 is invalid (checksum mismatch)"},
		{"meta 1 checksum", flip(orig, page+16+48), "meta page 1 is invalid (checksum mismatch)"},
		{"both meta pages", flip(orig, 16+40, page+16+40), "meta page 0 is invalid"},
		{"meta 0 magic", flip(orig, 16), "meta page 0 is invalid (no bbolt magic number)"},
		{"meta 1 version", flip(orig, page+16+4), "meta page 1 is invalid (file format version"},
		{"meta 0 page size", flip(orig, 16+8), "meta page 0 is invalid (checksum mismatch)"},
		{"garbage", garbage, "meta page 0 is invalid (no bbolt magic number)"},
		{"a few bytes", []byte("hello"), "meta page 0 is invalid (the file ends before it)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := os.WriteFile(path, tc.data, 0o600); err != nil {
				t.Fatal(err)
			}
			db, err := boltdb.Open(path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1()}}, lockTimeout)
			if err == nil {
				db.Close()
				t.Fatal("a damaged file opened")
			}
			if !errors.Is(err, boltdb.ErrCorrupt) || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q: want ErrCorrupt naming %s and %q", err, path, tc.want)
			}
			after, rerr := os.ReadFile(path)
			if rerr != nil || !bytes.Equal(after, tc.data) {
				t.Errorf("the file changed (%v)", rerr)
			}
		})
	}
}

func TestHealthyFilesOpen(t *testing.T) {
	for _, n := range []int{0, 1, 300} {
		path, _ := filled(t, n)
		db := open(t, path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1()}})
		var got int
		if err := db.View(func(tx *bolt.Tx) error { got = tx.Bucket(dataBucket).Stats().KeyN; return nil }); err != nil {
			t.Fatal(err)
		}
		db.Close()
		if got != n {
			t.Errorf("%d records, want %d", got, n)
		}
	}
	// An empty file is a new database, as bbolt treats it.
	path := filepath.Join(t.TempDir(), "empty.db")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	open(t, path, boltdb.Schema{Name: "svc", Migrations: []boltdb.Migration{m1()}}).Close()
}
