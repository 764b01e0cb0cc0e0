package attest

import (
	"crypto/sha256"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// swtpm is a real software TPM on a unix socket, as vm-manager runs it for VMs but
// with the server channel exposed (no simulator: that needs cgo).
type swtpm struct {
	dir, sock string
	cmd       *exec.Cmd
}

const swtpmFlags = "not-need-init,startup-clear"

// startSwtpm starts swtpm with its state in dir (a new one if empty) and stops it at
// the end of the test.
func startSwtpm(t *testing.T, dir, flags string) *swtpm {
	t.Helper()
	bin, err := exec.LookPath("swtpm")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("swtpm is required in CI: %v", err)
		}
		t.Skipf("swtpm not installed (%v): apt-get install swtpm swtpm-tools", err)
	}
	if dir == "" {
		// Not t.TempDir: unix socket paths are limited to 108 bytes.
		if dir, err = os.MkdirTemp("", "vmm-swtpm-"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
	}
	s := &swtpm{dir: dir, sock: filepath.Join(dir, "tpm.sock")}
	os.Remove(s.sock)
	s.cmd = exec.Command(bin, "socket", "--tpm2",
		"--server", "type=unixio,path="+s.sock,
		"--ctrl", "type=unixio,path="+filepath.Join(dir, "ctrl.sock"),
		"--tpmstate", "dir="+dir,
		"--flags", flags,
		"--log", "file="+filepath.Join(dir, "swtpm.log"))
	if err := s.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.stop)
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

// stop ends swtpm; SIGTERM makes it save its state first.
func (s *swtpm) stop() {
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

// withTPM runs f on a connection that is closed afterwards: swtpm serves one client
// at a time, so the code under test cannot connect while a test holds one.
func withTPM(t *testing.T, sock string, f func(transport.TPM)) {
	t.Helper()
	tpm, err := OpenTPM(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer tpm.Close()
	f(tpm)
}

// extend gives the PCRs distinct non-zero values, so a wrong order or index shows.
func extend(t *testing.T, tpm transport.TPM, pcrs ...uint) {
	t.Helper()
	for _, i := range pcrs {
		d := sha256.Sum256([]byte{byte(i), 'x'})
		_, err := tpm2.PCRExtend{
			PCRHandle: tpm2.AuthHandle{Handle: tpm2.TPMHandle(i), Auth: tpm2.PasswordAuth(nil)},
			Digests:   tpm2.TPMLDigestValues{Digests: []tpm2.TPMTHA{{HashAlg: tpm2.TPMAlgSHA256, Digest: d[:]}}},
		}.Execute(tpm)
		if err != nil {
			t.Fatalf("extending PCR %d: %v", i, err)
		}
	}
}

// transientHandles lists loaded transient objects: without a resource manager a
// leaked one would stay until the TPM resets.
func transientHandles(t *testing.T, tpm transport.TPM) []tpm2.TPMHandle {
	t.Helper()
	rsp, err := tpm2.GetCapability{Capability: tpm2.TPMCapHandles, Property: 0x80000000, PropertyCount: 16}.Execute(tpm)
	if err != nil {
		t.Fatal(err)
	}
	h, err := rsp.CapabilityData.Data.Handles()
	if err != nil {
		t.Fatal(err)
	}
	return h.Handle
}
