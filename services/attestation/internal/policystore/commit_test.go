package policystore

import (
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	bolt "go.etcd.io/bbolt"
)

// Concurrent verdict writes share commits, and every one that returned is in
// the file after a reopen.
func TestGroupCommitKeepsEveryWrite(t *testing.T) {
	path := filepath.Join(t.TempDir(), "attestation.db")
	st, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	const n = 200
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			if err := st.PutVM(&VM{ID: fmt.Sprintf("%08x", i), Image: "img_1"}, &attestationv1.Attestation{Boot: uint64(i)}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	cs := st.CommitStats()
	if cs.Writes != n || cs.Commits == 0 || cs.Commits > n {
		t.Fatalf("commit stats %+v, want %d writes", cs, n)
	}
	t.Logf("%d writes in %d commits", cs.Writes, cs.Commits)
	st.Close()
	if err := st.PutVM(&VM{ID: "0a0a0a0a"}, &attestationv1.Attestation{}); !errors.Is(err, errClosed) {
		t.Fatalf("PutVM after Close: %v, want errClosed", err)
	}

	st, err = Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for i := range n {
		if _, att, err := st.GetVM(fmt.Sprintf("%08x", i)); err != nil || att.GetBoot() != uint64(i) {
			t.Fatalf("vm %d after reopen: %v %v", i, att, err)
		}
	}
}

// A write that fails fails alone: the others of its group are committed.
func TestGroupCommitFailureIsItsOwn(t *testing.T) {
	st, err := Open(filepath.Join(t.TempDir(), "attestation.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	bad := errors.New("bad write")
	group := []*write{
		{fn: func(tx *bolt.Tx) error { return tx.Bucket(bucketVMs).Put([]byte("a"), []byte("{}")) }, err: make(chan error, 1)},
		{fn: func(*bolt.Tx) error { return bad }, err: make(chan error, 1)},
		{fn: func(tx *bolt.Tx) error { return tx.Bucket(bucketVMs).Put([]byte("b"), []byte("{}")) }, err: make(chan error, 1)},
	}
	st.vmw.commit(group)
	for i, want := range []error{nil, bad, nil} {
		if got := <-group[i].err; !errors.Is(got, want) {
			t.Errorf("write %d: %v, want %v", i, got, want)
		}
	}
	if err := st.db.View(func(tx *bolt.Tx) error {
		for _, k := range []string{"a", "b"} {
			if tx.Bucket(bucketVMs).Get([]byte(k)) == nil {
				return fmt.Errorf("%s not written", k)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}
