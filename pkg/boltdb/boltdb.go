// Package boltdb opens a service's bbolt database with a schema version and
// applies its migrations.
//
// Every database has a bucket "meta" with two keys:
//
//	meta/schema   the schema's name ("hypervisor", "attestation"), so one
//	              service never opens the other's file
//	meta/version  the schema version, decimal
//
// Migrations run in order, each in its own transaction together with the
// version bump, so a crash mid-way leaves the file at the last complete
// version. A file newer than the binary is refused, never downgraded.
package boltdb

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	bolt "go.etcd.io/bbolt"
)

var (
	metaBucket = []byte("meta")
	keySchema  = []byte("schema")
	keyVersion = []byte("version")
)

// ErrTooNew is returned for a database written by a newer binary.
var ErrTooNew = errors.New("database schema is newer than this binary")

// Migration moves a database from Version-1 to Version.
type Migration struct {
	Version     int
	Description string
	Apply       func(tx *bolt.Tx) error
}

// Schema names a database layout and lists its migrations, versions 1..N.
type Schema struct {
	Name       string
	Migrations []Migration
}

// CreateBuckets is a migration's Apply that creates the named buckets; one
// that exists already is left as it is.
func CreateBuckets(names ...[]byte) func(*bolt.Tx) error {
	return func(tx *bolt.Tx) error {
		for _, n := range names {
			if _, err := tx.CreateBucketIfNotExists(n); err != nil {
				return err
			}
		}
		return nil
	}
}

// RewriteValues is for a migration that rewrites the records of a bucket:
// rewrite gets each key and value and answers the new value, with write
// false to leave the key as it is. The writes happen after the walk (bbolt
// forbids changing a bucket ForEach walks); an error of rewrite or of a write
// stops it and is the answer.
func RewriteValues(b *bolt.Bucket, rewrite func(k, v []byte) (newV []byte, write bool, err error)) error {
	type update struct{ k, v []byte }
	var updates []update
	if err := b.ForEach(func(k, v []byte) error {
		nv, write, err := rewrite(k, v)
		if err != nil || !write {
			return err
		}
		updates = append(updates, update{append([]byte(nil), k...), nv})
		return nil
	}); err != nil {
		return err
	}
	for _, u := range updates {
		if err := b.Put(u.k, u.v); err != nil {
			return err
		}
	}
	return nil
}

// Latest is the version the binary writes.
func (s Schema) Latest() int {
	if n := len(s.Migrations); n > 0 {
		return s.Migrations[n-1].Version
	}
	return 0
}

// Open opens (or creates, mode 0600) the database at path and migrates it to
// the schema's latest version. A file held by another process fails after
// lockTimeout (bbolt takes an flock on it). A damaged file (a meta page that
// does not validate, a file shorter than its pages) is refused with
// ErrCorrupt before anything is written to it.
func Open(path string, s Schema, lockTimeout time.Duration) (*bolt.DB, error) {
	for i, m := range s.Migrations {
		if m.Version != i+1 {
			return nil, fmt.Errorf("schema %s: migration %d has version %d", s.Name, i, m.Version)
		}
	}
	if err := checkFile(path); err != nil {
		return nil, fmt.Errorf("open %s: %w; the file was left as it is: restore it from a backup, or move it aside to start with an empty database", path, err)
	}
	db, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: lockTimeout})
	if err != nil {
		if errors.Is(err, bolt.ErrTimeout) {
			return nil, fmt.Errorf("open %s: held by another process", path)
		}
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	if err := migrate(db, s); err != nil {
		db.Close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return db, nil
}

// Version reads the schema name and version of an open database.
func Version(db *bolt.DB) (name string, version int, err error) {
	err = db.View(func(tx *bolt.Tx) error {
		name, version, err = readMeta(tx)
		return err
	})
	return name, version, err
}

func readMeta(tx *bolt.Tx) (string, int, error) {
	b := tx.Bucket(metaBucket)
	if b == nil {
		return "", 0, nil
	}
	v := 0
	if raw := b.Get(keyVersion); raw != nil {
		n, err := strconv.Atoi(string(raw))
		if err != nil || n < 0 {
			return "", 0, fmt.Errorf("meta/version %q is not a version number", raw)
		}
		v = n
	}
	return string(b.Get(keySchema)), v, nil
}

func migrate(db *bolt.DB, s Schema) error {
	name, current, err := Version(db)
	if err != nil {
		return err
	}
	if name != "" && name != s.Name {
		return fmt.Errorf("database belongs to %q, not %q", name, s.Name)
	}
	if current > s.Latest() {
		return fmt.Errorf("%w: version %d, this binary knows up to %d", ErrTooNew, current, s.Latest())
	}
	for _, m := range s.Migrations[current:] {
		err := db.Update(func(tx *bolt.Tx) error {
			if err := m.Apply(tx); err != nil {
				return err
			}
			meta, err := tx.CreateBucketIfNotExists(metaBucket)
			if err != nil {
				return err
			}
			if err := meta.Put(keySchema, []byte(s.Name)); err != nil {
				return err
			}
			return meta.Put(keyVersion, []byte(strconv.Itoa(m.Version)))
		})
		if err != nil {
			return fmt.Errorf("migration to version %d (%s): %w", m.Version, m.Description, err)
		}
	}
	return nil
}
