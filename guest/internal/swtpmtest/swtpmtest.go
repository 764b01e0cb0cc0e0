// Package swtpmtest runs a real software TPM (swtpm) on a unix socket for
// tests, as vm-manager runs one for a VM but with the server channel exposed
// (no simulator: that needs cgo). Only tests import it.
package swtpmtest

import (
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// DefaultFlags are swtpm's --flags unless Flags says otherwise: no
// CMD_INIT needed, and TPM2_Startup(CLEAR) done, as a booted guest finds it.
const DefaultFlags = "not-need-init,startup-clear"

// TPM is a running swtpm.
type TPM struct {
	dir, sock string
	cmd       *exec.Cmd
}

// Option changes how Start runs swtpm.
type Option func(*options)

type options struct{ flags string }

// Flags replaces DefaultFlags as swtpm's --flags.
func Flags(flags string) Option { return func(o *options) { o.flags = flags } }

// Start starts swtpm with its state in dir (a new TempDir if empty) and stops
// it at the end of the test. Without swtpm installed the test is skipped,
// saying why, except on CI (CI=true), where that is a failure.
func Start(t testing.TB, dir string, opts ...Option) *TPM {
	t.Helper()
	o := options{flags: DefaultFlags}
	for _, opt := range opts {
		opt(&o)
	}
	bin, err := exec.LookPath("swtpm")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("swtpm is required in CI: %v", err)
		}
		t.Skipf("swtpm not installed (%v): apt-get install swtpm swtpm-tools", err)
	}
	if dir == "" {
		dir = TempDir(t)
	}
	s := &TPM{dir: dir, sock: filepath.Join(dir, "tpm.sock")}
	os.Remove(s.sock)
	s.cmd = exec.Command(bin, "socket", "--tpm2",
		"--server", "type=unixio,path="+s.sock,
		"--ctrl", "type=unixio,path="+filepath.Join(dir, "ctrl.sock"),
		"--tpmstate", "dir="+dir,
		"--flags", o.flags,
		"--log", "file="+filepath.Join(dir, "swtpm.log"))
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		// The file appears at bind(), before listen(): wait for a connection.
		if c, err := net.Dial("unix", s.sock); err == nil {
			c.Close()
			return s
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(dir, "swtpm.log"))
			t.Fatalf("swtpm socket %s did not appear; log:\n%s", s.sock, log)
		}
	}
}

// Socket is the TPM's server socket (one client at a time).
func (s *TPM) Socket() string { return s.sock }

// Dir is the TPM's state directory: Start it again there after Stop for a
// reboot.
func (s *TPM) Dir() string { return s.dir }

// Stop ends swtpm; SIGTERM makes it save its state first. Stopping a
// stopped TPM does nothing.
func (s *TPM) Stop() {
	if s.cmd.ProcessState != nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = s.cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		_ = s.cmd.Process.Kill()
		<-done
	}
}

// TempDir is a new directory removed at the end of the test. Not t.TempDir:
// unix socket paths are limited to 108 bytes, and t.TempDir's can be longer.
func TempDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "vmm-swtpm-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}
