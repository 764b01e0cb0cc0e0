package boltdb_test

import (
	"errors"
	"path/filepath"
	"testing"

	"github.com/giantswarm/vm-manager/pkg/boltdb"
	bolt "go.etcd.io/bbolt"
)

func TestRewriteValues(t *testing.T) {
	path := filepath.Join(t.TempDir(), "db")
	s := boltdb.Schema{Name: "test", Migrations: []boltdb.Migration{
		{Version: 1, Description: "b", Apply: boltdb.CreateBuckets([]byte("b"))},
	}}
	db := open(t, path, s)
	defer db.Close()
	if err := db.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte("b"))
		for _, k := range []string{"x", "y", "z"} {
			if err := b.Put([]byte(k), []byte("old")); err != nil {
				return err
			}
		}
		return boltdb.RewriteValues(b, func(k, v []byte) ([]byte, bool, error) {
			if string(k) == "y" {
				return nil, false, nil // left as it is
			}
			return append([]byte("new-"), v...), true, nil
		})
	}); err != nil {
		t.Fatal(err)
	}
	if err := db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte("b"))
		for k, want := range map[string]string{"x": "new-old", "y": "old", "z": "new-old"} {
			if got := string(b.Get([]byte(k))); got != want {
				t.Errorf("b/%s = %q, want %q", k, got, want)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}

	boom := errors.New("boom")
	err := db.Update(func(tx *bolt.Tx) error {
		return boltdb.RewriteValues(tx.Bucket([]byte("b")), func(k, v []byte) ([]byte, bool, error) { return nil, false, boom })
	})
	if !errors.Is(err, boom) {
		t.Fatalf("RewriteValues with a failing rewrite: %v, want its error", err)
	}
}
