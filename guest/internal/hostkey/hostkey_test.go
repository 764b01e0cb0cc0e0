package hostkey

import (
	"bytes"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"

	"github.com/giantswarm/vm-manager/guest/internal/attest"
)

// startSwtpm starts a real software TPM on a unix socket with its state in dir, as
// internal/attest's tests do, and stops it (saving its state) at the end of the test.
func startSwtpm(t *testing.T, dir string) (sock string, stop func()) {
	t.Helper()
	bin, err := exec.LookPath("swtpm")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("swtpm is required in CI: %v", err)
		}
		t.Skipf("swtpm not installed (%v): apt-get install swtpm swtpm-tools", err)
	}
	sock = filepath.Join(dir, "tpm.sock")
	os.Remove(sock)
	cmd := exec.Command(bin, "socket", "--tpm2",
		"--server", "type=unixio,path="+sock,
		"--ctrl", "type=unixio,path="+filepath.Join(dir, "ctrl.sock"),
		"--tpmstate", "dir="+dir,
		"--flags", "not-need-init,startup-clear",
		"--log", "file="+filepath.Join(dir, "swtpm.log"))
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	stop = func() {
		if cmd.ProcessState != nil {
			return
		}
		_ = cmd.Process.Signal(syscall.SIGTERM) // swtpm saves its state first
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	}
	t.Cleanup(stop)
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		// The file appears at bind(), before listen(): wait for a connection.
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			return sock, stop
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(dir, "swtpm.log"))
			t.Fatalf("swtpm socket %s did not appear; log:\n%s", sock, log)
		}
	}
}

func tempDir(t *testing.T) string {
	t.Helper()
	// Not t.TempDir: unix socket paths are limited to 108 bytes.
	dir, err := os.MkdirTemp("", "vmm-hostkey-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// rw is a TPM as the io.ReadWriter LoadOrCreate takes (a device file at boot): one
// Write sends a command, the next Read returns the whole response.
type rw struct {
	t   transport.TPM
	rsp []byte
}

func (r *rw) Write(p []byte) (int, error) {
	rsp, err := r.t.Send(p)
	if err != nil {
		return 0, err
	}
	r.rsp = rsp
	return len(p), nil
}

func (r *rw) Read(p []byte) (int, error) {
	n := copy(p, r.rsp)
	r.rsp = r.rsp[n:]
	return n, nil
}

func loadOrCreate(t *testing.T, sock string) ([]byte, bool) {
	t.Helper()
	tpm, err := attest.OpenTPM(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer tpm.Close() // swtpm serves one client at a time
	key, created, err := LoadOrCreate(&rw{t: tpm})
	if err != nil {
		t.Fatal(err)
	}
	return key, created
}

func TestLoadOrCreate(t *testing.T) {
	dir := tempDir(t)
	sock, stop := startSwtpm(t, dir)

	k1, created := loadOrCreate(t, sock)
	if !created || len(k1) != 64 {
		t.Fatalf("first call: created=%v, %d byte key", created, len(k1))
	}
	k2, created := loadOrCreate(t, sock)
	if created || !bytes.Equal(k1, k2) {
		t.Fatalf("second call: created=%v, same key %v", created, bytes.Equal(k1, k2))
	}

	// A reboot: swtpm restarts from its saved state.
	stop()
	sock, _ = startSwtpm(t, dir)
	k3, created := loadOrCreate(t, sock)
	if created || !bytes.Equal(k1, k3) {
		t.Fatalf("after restart: created=%v, same key %v", created, bytes.Equal(k1, k3))
	}

	// Another TPM, another key.
	k4, created := loadOrCreate(t, func() string { s, _ := startSwtpm(t, tempDir(t)); return s }())
	if !created || bytes.Equal(k1, k4) {
		t.Fatalf("fresh TPM: created=%v, same key %v", created, bytes.Equal(k1, k4))
	}
}

// An index someone else defined at NVIndex is left alone.
func TestForeignIndex(t *testing.T) {
	sock, _ := startSwtpm(t, tempDir(t))
	tpm, err := attest.OpenTPM(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer tpm.Close()
	_, err = tpm2.NVDefineSpace{
		AuthHandle: tpm2.TPMRHOwner,
		PublicInfo: tpm2.New2B(tpm2.TPMSNVPublic{
			NVIndex: NVIndex, NameAlg: tpm2.TPMAlgSHA256, Attributes: attributes, DataSize: 16,
		}),
	}.Execute(tpm)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := LoadOrCreate(&rw{t: tpm}); err == nil {
		t.Fatal("a 16-byte index was used")
	}
	if _, err := (tpm2.NVReadPublic{NVIndex: NVIndex}).Execute(tpm); errors.Is(err, tpm2.TPMRCHandle) {
		t.Fatal("the foreign index was removed")
	}
}

// An index defined but never written (power lost right after the define) gets
// its seed on the next boot.
func TestDefinedNotWritten(t *testing.T) {
	sock, _ := startSwtpm(t, tempDir(t))
	tpm, err := attest.OpenTPM(sock)
	if err != nil {
		t.Fatal(err)
	}
	if err := define(tpm); err != nil {
		t.Fatal(err)
	}
	tpm.Close()
	k1, created := loadOrCreate(t, sock)
	if !created {
		t.Error("unwritten index: created=false")
	}
	k2, created := loadOrCreate(t, sock)
	if created || !bytes.Equal(k1, k2) {
		t.Errorf("second call: created=%v, same key %v", created, bytes.Equal(k1, k2))
	}
}
