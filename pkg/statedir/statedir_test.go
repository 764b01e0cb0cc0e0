package statedir_test

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/pkg/statedir"
)

func TestAcquireCreatesDir0700AndWritesPID(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state", "nested")
	l, err := statedir.Acquire(dir, "hypervisor")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	fi, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !fi.IsDir() || fi.Mode().Perm() != 0o700 {
		t.Errorf("dir mode = %v, want drwx------", fi.Mode())
	}
	lockPath := filepath.Join(dir, "hypervisor.lock")
	lfi, err := os.Stat(lockPath)
	if err != nil {
		t.Fatal(err)
	}
	if lfi.Mode().Perm() != 0o600 {
		t.Errorf("lock file mode = %o, want 600", lfi.Mode().Perm())
	}
	b, err := os.ReadFile(lockPath)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := string(b), strconv.Itoa(os.Getpid())+"\n"; got != want {
		t.Errorf("lock file = %q, want %q", got, want)
	}
}

func TestSecondAcquireConflicts(t *testing.T) {
	dir := t.TempDir()
	l, err := statedir.Acquire(dir, "attestation")
	if err != nil {
		t.Fatal(err)
	}
	// flock locks belong to the open file description, so a second Acquire in
	// the same process conflicts just like another process would.
	l2, err := statedir.Acquire(dir, "attestation")
	if err == nil {
		l2.Release()
		t.Fatal("second Acquire succeeded while the first is held")
	}
	if !errors.Is(err, statedir.ErrInUse) {
		t.Errorf("err = %v, want ErrInUse", err)
	}
	if want := fmt.Sprintf("pid %d", os.Getpid()); !strings.Contains(err.Error(), want) {
		t.Errorf("err = %q, want it to contain %q", err, want)
	}
	if !strings.Contains(err.Error(), filepath.Join(dir, "attestation.lock")) {
		t.Errorf("err = %q, want the lock path", err)
	}
	// The failed attempt must not have clobbered the holder's PID.
	b, _ := os.ReadFile(filepath.Join(dir, "attestation.lock"))
	if strings.TrimSpace(string(b)) != strconv.Itoa(os.Getpid()) {
		t.Errorf("lock file after conflict = %q", b)
	}

	if err := l.Release(); err != nil {
		t.Fatalf("Release: %v", err)
	}
	l3, err := statedir.Acquire(dir, "attestation")
	if err != nil {
		t.Fatalf("Acquire after Release: %v", err)
	}
	if err := l3.Release(); err != nil {
		t.Fatal(err)
	}
}

func TestUnknownHolderNamed(t *testing.T) {
	// A lock file without a PID still gives ErrInUse, naming "another process".
	dir := t.TempDir()
	l, err := statedir.Acquire(dir, "x")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	if err := os.WriteFile(filepath.Join(dir, "x.lock"), []byte("garbage"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = statedir.Acquire(dir, "x")
	if !errors.Is(err, statedir.ErrInUse) || !strings.Contains(err.Error(), "another process") {
		t.Errorf("err = %v", err)
	}
}

func TestDifferentNamesAreIndependent(t *testing.T) {
	dir := t.TempDir()
	a, err := statedir.Acquire(dir, "hypervisor")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Release()
	b, err := statedir.Acquire(dir, "attestation")
	if err != nil {
		t.Fatalf("a different name conflicted: %v", err)
	}
	defer b.Release()
	if _, err := statedir.Acquire(dir, "hypervisor"); !errors.Is(err, statedir.ErrInUse) {
		t.Errorf("hypervisor re-acquire err = %v, want ErrInUse", err)
	}
}

func TestReleaseIsIdempotent(t *testing.T) {
	l, err := statedir.Acquire(t.TempDir(), "n")
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(); err != nil {
		t.Fatal(err)
	}
	if err := l.Release(); err != nil {
		t.Errorf("second Release = %v", err)
	}
	var nilLock *statedir.Lock
	if err := nilLock.Release(); err != nil {
		t.Errorf("nil Release = %v", err)
	}
}

func TestAcquireFailsWhenDirIsAFile(t *testing.T) {
	f := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(f, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := statedir.Acquire(f, "x")
	if err == nil || errors.Is(err, statedir.ErrInUse) {
		t.Errorf("err = %v, want a non-ErrInUse error", err)
	}
}

func TestDefault(t *testing.T) {
	t.Setenv("XDG_STATE_HOME", "/tmp/xdg-state")
	if got := statedir.Default(); got != "/tmp/xdg-state/vm-manager" {
		t.Errorf("Default with XDG_STATE_HOME = %q", got)
	}
	t.Setenv("XDG_STATE_HOME", "")
	t.Setenv("HOME", "/home/tester")
	if got := statedir.Default(); got != "/home/tester/.local/state/vm-manager" {
		t.Errorf("Default with HOME = %q", got)
	}
	t.Setenv("HOME", "/")
	if got := statedir.Default(); got != "/var/lib/vm-manager" {
		t.Errorf("Default with HOME=/ = %q", got)
	}
}
