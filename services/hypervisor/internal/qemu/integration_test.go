package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/proc"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/swtpm"
)

const (
	qemuBinary = "qemu-system-x86_64"
	ovmfCode   = "/usr/share/OVMF/OVMF_CODE_4M.fd"
	ovmfVars   = "/usr/share/OVMF/OVMF_VARS_4M.fd"
)

// need skips when a host tool is missing, but fails in CI, where a skip
// would hide that the integration tests never ran.
func need(t *testing.T, what string, ok bool) {
	t.Helper()
	if ok {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s is missing (CI=true: integration tests must run)", what)
	}
	t.Skipf("%s is missing: install qemu-system-x86, ovmf and swtpm to run this test", what)
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// vmFixture is a firmware-only VM in a temporary state directory.
type vmFixture struct {
	dir  string
	spec Spec
}

func newVM(t *testing.T) *vmFixture {
	t.Helper()
	_, err := exec.LookPath(qemuBinary)
	need(t, qemuBinary, err == nil)
	need(t, ovmfCode, fileExists(ovmfCode) && fileExists(ovmfVars))
	// Short socket paths: t.TempDir() can exceed the 107-byte limit.
	dir, err := os.MkdirTemp("", "vmm-qemu-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	vars := filepath.Join(dir, "ovmf_vars.fd")
	copyFile(t, ovmfVars, vars)
	v, err := ProbeVersion(context.Background(), qemuBinary)
	if err != nil {
		t.Fatal(err)
	}
	return &vmFixture{dir: dir, spec: Spec{
		ID:          "it" + filepath.Base(dir)[len("vmm-qemu-"):],
		QEMUVersion: v,
		Accel:       AccelTCG,
		CPUs:        1,
		MemoryMiB:   256,
		ConsoleLog:  filepath.Join(dir, "console.log"),
		QMPSocket:   filepath.Join(dir, "qmp.sock"),
		OVMFCode:    ovmfCode,
		OVMFVars:    vars,
		Boot:        BootFirmware,
	}}
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	in, err := os.Open(from)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}

// start runs QEMU from the fixture's Spec and connects QMP.
func (f *vmFixture) start(t *testing.T) (*proc.Process, *Monitor) {
	t.Helper()
	args, err := f.spec.Args()
	if err != nil {
		t.Fatal(err)
	}
	logf, err := os.OpenFile(filepath.Join(f.dir, "qemu.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command(qemuBinary, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	t0 := time.Now()
	p, err := proc.Start(cmd)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Terminate(5 * time.Second) })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	m, err := Connect(ctx, f.spec.QMPSocket)
	if err != nil {
		t.Fatalf("QMP: %v; qemu.log: %s", err, f.log())
	}
	t.Cleanup(func() { m.Close() })
	t.Logf("QEMU start to QMP connected: %v", time.Since(t0))
	return p, m
}

func (f *vmFixture) log() string {
	b, _ := os.ReadFile(filepath.Join(f.dir, "qemu.log"))
	return string(b)
}

func waitExit(t *testing.T, p *proc.Process, d time.Duration) {
	t.Helper()
	select {
	case <-p.Done():
	case <-time.After(d):
		t.Fatalf("process %d still runs after %v", p.PID, d)
	}
}

func TestQEMUPowerdownThenQuit(t *testing.T) {
	f := newVM(t)
	p, m := f.start(t)
	ctx := ctxT(t, 30*time.Second)

	st, err := m.Status(ctx)
	if err != nil || st != "running" {
		t.Fatalf("Status = %q, %v", st, err)
	}
	if v := m.Version(); v != f.spec.QEMUVersion {
		t.Errorf("QMP greeting says %v, --version says %v", v, f.spec.QEMUVersion)
	}
	if err := m.Powerdown(ctx); err != nil {
		t.Fatal(err)
	}
	// No OS: the firmware ignores the ACPI power button.
	e := nextEvent(t, m, "POWERDOWN", 5*time.Second)
	t.Logf("POWERDOWN event %+v", e)
	select {
	case <-p.Done():
		t.Fatal("QEMU exited on an ACPI power-down without an OS")
	case <-time.After(time.Second):
	}

	t0 := time.Now()
	if err := m.Quit(ctx); err != nil {
		t.Fatal(err)
	}
	e = nextEvent(t, m, "SHUTDOWN", 5*time.Second)
	if e.Data["reason"] != "host-qmp-quit" {
		t.Errorf("SHUTDOWN data %v", e.Data)
	}
	waitExit(t, p, 10*time.Second)
	t.Logf("quit to exit: %v", time.Since(t0))
	if code, known := p.ExitCode(); !known || code != 0 {
		t.Errorf("exit code %d (known %v); qemu.log: %s", code, known, f.log())
	}
	<-m.Done()
}

// waitNetdev waits until "info network" says whether net0 has a client on
// sock (QEMU 7.2 prints "type=stream,unix:<path>" while connected and
// "type=stream," while listening).
func waitNetdev(t *testing.T, m *Monitor, sock string, connected bool) {
	t.Helper()
	req := []byte(`{"execute":"human-monitor-command","arguments":{"command-line":"info network"}}`)
	deadline := time.Now().Add(5 * time.Second)
	for {
		raw, err := m.mon.Run(req)
		if err != nil {
			t.Fatalf("info network: %v", err)
		}
		var resp struct{ Return string }
		if err := json.Unmarshal(raw, &resp); err != nil {
			t.Fatalf("info network: %v", err)
		}
		if strings.Contains(resp.Return, "type=stream,unix:"+sock) == connected {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("net0 connected=%v expected, info network says:\n%s", connected, resp.Return)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func nextEvent(t *testing.T, m *Monitor, name string, d time.Duration) Event {
	t.Helper()
	timeout := time.After(d)
	for {
		select {
		case e, ok := <-m.Events():
			if !ok {
				t.Fatalf("event stream ended before %s", name)
			}
			if e.Name == name {
				return e
			}
		case <-timeout:
			t.Fatalf("no %s event within %v", name, d)
		}
	}
}

func TestQEMUCloseThenReconnect(t *testing.T) {
	f := newVM(t)
	p, m := f.start(t)
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	m2, err := Connect(ctxT(t, 10*time.Second), f.spec.QMPSocket)
	if err != nil {
		t.Fatalf("second connect: %v", err)
	}
	defer m2.Close()
	t.Logf("reconnect after Close: %v", time.Since(t0))
	if st, err := m2.Status(ctxT(t, 10*time.Second)); err != nil || st != "running" {
		t.Fatalf("Status on the second connection = %q, %v", st, err)
	}
	if err := m2.Quit(ctxT(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	waitExit(t, p, 10*time.Second)
}

// TestQEMUDiskBootWithSwtpmNetworkAndNotify runs the fullest argv this host
// supports (installed-disk boot, swtpm, network, virtio-serial notify,
// credentials) on a real QEMU and swtpm.
func TestQEMUDiskBootWithSwtpmNetworkAndNotify(t *testing.T) {
	f := newVM(t)
	_, err := exec.LookPath(swtpm.DefaultBinary)
	need(t, swtpm.DefaultBinary, err == nil)

	cfg := swtpm.Config{StateDir: filepath.Join(f.dir, "tpm")}.WithDefaults()
	t0 := time.Now()
	tpm, err := swtpm.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tpm.Terminate(swtpm.StopGrace) })
	t.Logf("swtpm start to control channel answering: %v", time.Since(t0))

	// QEMU listens on the network socket; the network dials it.
	netSock := filepath.Join(f.dir, "net.sock")
	volume := filepath.Join(f.dir, "volume")
	if err := os.WriteFile(volume, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(volume, 64<<20); err != nil {
		t.Fatal(err)
	}

	f.spec.Boot = BootDisk
	f.spec.Volume = volume
	f.spec.FirstBoot = true
	f.spec.NetdevSocket = netSock
	f.spec.MAC = "52:54:00:12:34:56"
	f.spec.SwtpmSocket = cfg.CtrlSocket
	f.spec.NotifySocket = filepath.Join(f.dir, "notify.sock")
	f.spec.Credentials = map[string]string{
		"system.machine_id":        "0123456789abcdef0123456789abcdef",
		"firstboot.hostname":       "a,b",
		"ssh.authorized_keys.root": "ssh-ed25519 AAAA x\n",
	}
	p, m := f.start(t)
	if st, err := m.Status(ctxT(t, 10*time.Second)); err != nil || st != "running" {
		t.Fatalf("Status = %q, %v; qemu.log: %s", st, err, f.log())
	}
	// The network dials QEMU's socket, and dials it again after dropping
	// the connection, as a restarted hypervisor does: QEMU must accept both.
	for i := range 2 {
		c, err := net.DialTimeout("unix", netSock, 2*time.Second)
		if err != nil {
			t.Fatalf("dial %d of the network socket: %v; qemu.log: %s", i+1, err, f.log())
		}
		waitNetdev(t, m, netSock, true)
		c.Close()
		waitNetdev(t, m, netSock, false)
	}
	// QEMU listens on the notify socket (server=on,wait=off).
	c, err := net.DialTimeout("unix", f.spec.NotifySocket, 2*time.Second)
	if err != nil {
		t.Fatalf("notify socket: %v", err)
	}
	c.Close()

	// swtpm serves one control client at a time and QEMU keeps its control
	// connection open: a probe of an swtpm in use goes unanswered. An
	// adopting hypervisor must rely on the PID and start time instead.
	// QEMU opened that connection (and asked swtpm's capabilities on it)
	// while it initialised its TPM backend, before QMP answered above.
	if err := swtpm.Probe(ctxT(t, 500*time.Millisecond), cfg.CtrlSocket); !errors.Is(err, swtpm.ErrUnresponsive) {
		t.Errorf("probe while QEMU holds the control channel: %v, want ErrUnresponsive", err)
	}

	if err := m.Quit(ctxT(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	waitExit(t, p, 10*time.Second)
	// --terminate: swtpm ends once QEMU closed the data channel.
	t2 := time.Now()
	waitExit(t, tpm, 10*time.Second)
	t.Logf("swtpm exit after QEMU exit: %v", time.Since(t2))
	if !fileExists(filepath.Join(cfg.StateDir, "tpm2-00.permall")) {
		t.Error("no tpm2-00.permall in the state dir")
	}
	if _, err := os.Stat(cfg.CtrlSocket); !errors.Is(err, os.ErrNotExist) {
		t.Logf("control socket after exit: %v", err)
	}
}
