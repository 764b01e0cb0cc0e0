package guest_test

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/guest/internal/sdnotify"
)

// The test guest boots for real: OVMF, swtpm, QEMU under TCG (KVM is optional and
// not needed), READY=1 over virtio-serial, then ACPI power-off via QMP.

const (
	ovmfCode = "/usr/share/OVMF/OVMF_CODE_4M.fd"
	ovmfVars = "/usr/share/OVMF/OVMF_VARS_4M.fd"
)

var (
	imageOnce  sync.Once
	imageDir   string
	imageErr   error
	imageBuilt bool // imageDir is ours to remove
)

func TestMain(m *testing.M) {
	code := m.Run()
	if imageBuilt {
		os.RemoveAll(imageDir)
	}
	os.Exit(code)
}

// guestImage returns the directory holding test-guest_<v>.*: $VMM_GUEST_IMAGE_DIR or
// $VMM_TEST_IMAGE_DIR (what `make test` sets), else one built once per test binary by
// hack/guest-image.sh.
func guestImage(t *testing.T) string {
	imageOnce.Do(func() {
		for _, env := range []string{"VMM_GUEST_IMAGE_DIR", "VMM_TEST_IMAGE_DIR"} {
			if d := os.Getenv(env); d != "" {
				imageDir = d
				return
			}
		}
		d, err := os.MkdirTemp("", "vmm-guest-image-")
		if err != nil {
			imageErr = err
			return
		}
		imageDir, imageBuilt = d, true
		script, _ := filepath.Abs("../hack/guest-image.sh")
		out, err := exec.Command("bash", script, d).CombinedOutput()
		if err != nil {
			imageErr = fmt.Errorf("%s: %v\n%s", script, err, out)
		}
	})
	if imageErr != nil {
		t.Fatal(imageErr)
	}
	return imageDir
}

func requireHost(t *testing.T) {
	var missing []string
	for _, bin := range []string{"qemu-system-x86_64", "swtpm"} {
		if _, err := exec.LookPath(bin); err != nil {
			missing = append(missing, bin)
		}
	}
	for _, f := range []string{ovmfCode, ovmfVars} {
		if _, err := os.Stat(f); err != nil {
			missing = append(missing, f)
		}
	}
	if len(missing) == 0 {
		return
	}
	msg := "missing " + strings.Join(missing, ", ") + " (make deps installs them)"
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

func TestBootTestGuest(t *testing.T) {
	if testing.Short() {
		t.Skip("boots a VM")
	}
	requireHost(t)
	img := guestImage(t)
	version := os.Getenv("GUEST_VERSION")
	if version == "" {
		version = "0.1.0"
	}
	stem := filepath.Join(img, "test-guest_"+version)
	cmdline, err := os.ReadFile(stem + ".cmdline")
	if err != nil {
		t.Fatal(err)
	}
	accel := os.Getenv("VMM_GUEST_ACCEL")
	if accel == "" {
		accel = "tcg"
	}

	// Short absolute paths: unix socket paths are limited to 107 bytes.
	dir, err := os.MkdirTemp("", "vmm-boot-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	p := func(name string) string { return filepath.Join(dir, name) }
	consoleLog := p("console.log")
	defer func() {
		if t.Failed() {
			b, _ := os.ReadFile(consoleLog)
			q, _ := os.ReadFile(p("qemu.log"))
			t.Logf("console.log:\n%s\nqemu.log:\n%s", tail(b, 80), q)
		}
	}()
	vars, err := os.ReadFile(ovmfVars)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p("ovmf_vars.fd"), vars, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(p("tpm"), 0o700); err != nil {
		t.Fatal(err)
	}

	swtpm := start(t, p("swtpm.log"), "swtpm", "socket", "--tpm2",
		"--tpmstate", "dir="+p("tpm"),
		"--ctrl", "type=unixio,path="+p("swtpm.sock"),
		"--flags", "not-need-init", "--terminate")
	waitSwtpm(t, p("swtpm.sock"), swtpm)

	started := time.Now()
	qemu := start(t, p("qemu.log"), "qemu-system-x86_64",
		"-machine", "q35", "-accel", accel, "-m", "512", "-smp", "1",
		"-nodefaults", "-display", "none", "-no-reboot",
		"-serial", "file:"+consoleLog,
		"-qmp", "unix:"+p("qmp.sock")+",server=on,wait=off",
		"-drive", "if=pflash,format=raw,unit=0,readonly=on,file="+ovmfCode,
		"-drive", "if=pflash,format=raw,unit=1,file="+p("ovmf_vars.fd"),
		"-kernel", stem+".vmlinuz", "-initrd", stem+".initrd",
		"-append", strings.TrimSpace(string(cmdline)),
		"-chardev", "socket,id=chrtpm,path="+p("swtpm.sock"),
		"-tpmdev", "emulator,id=tpm0,chardev=chrtpm",
		"-device", "tpm-crb,tpmdev=tpm0",
		"-device", "virtio-rng-pci",
		"-device", "virtio-serial-pci",
		"-chardev", "socket,id=notify,path="+p("notify.sock")+",server=on,wait=off",
		"-device", "virtserialport,chardev=notify,name="+sdnotify.PortName,
		"-smbios", "type=1,manufacturer=GiantSwarm,product=vm-manager,serial=test",
		"-smbios", "type=11,value=io.systemd.credential:firstboot.hostname=t1",
		"-smbios", "type=11,value=io.systemd.credential:system.machine_id=0123456789abcdef0123456789abcdef",
	)

	msgs := readUntilReady(t, p("notify.sock"), qemu, 90*time.Second)
	t.Logf("boot to READY=1 (%s): %.2fs; messages: %q", accel, time.Since(started).Seconds(), msgs)

	console, _ := os.ReadFile(consoleLog)
	for _, want := range []string{"vm-agent: modules loaded", "vm-agent: hostname t1", "vm-agent: machine-id 0123456789abcdef0123456789abcdef", "vm-agent: ready"} {
		if !bytes.Contains(console, []byte(want)) {
			t.Errorf("console.log lacks %q", want)
		}
	}

	qmp(t, p("qmp.sock"), "qmp_capabilities", "system_powerdown")
	if err := qemu.wait(60 * time.Second); err != nil {
		t.Fatalf("qemu after system_powerdown: %v", err)
	}
	if err := swtpm.wait(10 * time.Second); err != nil {
		t.Fatalf("swtpm after qemu exit: %v", err)
	}
	console, _ = os.ReadFile(consoleLog)
	if !bytes.Contains(console, []byte("vm-agent: power button, powering off")) {
		t.Errorf("console.log lacks the power button line")
	}
}

// proc is a started child that is always reaped: killed at cleanup if still running.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

func start(t *testing.T, logPath, name string, args ...string) *proc {
	t.Helper()
	log, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		log.Close()
		t.Fatal(err)
	}
	pr := &proc{name: name, cmd: cmd, done: make(chan struct{})}
	go func() {
		pr.err = cmd.Wait()
		log.Close()
		close(pr.done)
	}()
	t.Cleanup(func() {
		select {
		case <-pr.done:
		default:
			cmd.Process.Kill()
			<-pr.done
		}
	})
	return pr
}

func (pr *proc) exited() bool {
	select {
	case <-pr.done:
		return true
	default:
		return false
	}
}

// wait expects a clean exit (status 0) within d.
func (pr *proc) wait(d time.Duration) error {
	select {
	case <-pr.done:
		return pr.err
	case <-time.After(d):
		return fmt.Errorf("%s still running after %s", pr.name, d)
	}
}

// waitSwtpm waits for the control socket and checks swtpm answers CMD_GET_CAPABILITY.
func waitSwtpm(t *testing.T, sock string, swtpm *proc) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.Dial("unix", sock)
		if err == nil {
			defer c.Close()
			c.SetDeadline(time.Now().Add(5 * time.Second))
			if err := binary.Write(c, binary.BigEndian, uint32(1)); err != nil {
				t.Fatal(err)
			}
			var resp [8]byte
			if _, err := io.ReadFull(c, resp[:]); err != nil {
				t.Fatalf("swtpm control socket: %v", err)
			}
			return
		}
		if swtpm.exited() || time.Now().After(deadline) {
			t.Fatalf("swtpm control socket %s: %v (exited: %v)", sock, err, swtpm.err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// readUntilReady connects to the host end of the notify port (QEMU listens) and reads
// NUL-terminated messages until one carries READY=1.
func readUntilReady(t *testing.T, sock string, qemu *proc, timeout time.Duration) []string {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var c net.Conn
	for {
		var err error
		if c, err = net.Dial("unix", sock); err == nil {
			break
		}
		if qemu.exited() {
			t.Fatalf("qemu exited before READY=1: %v", qemu.err)
		}
		if time.Now().After(deadline) {
			t.Fatalf("notify socket: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	defer c.Close()
	c.SetReadDeadline(deadline)
	sc := bufio.NewScanner(c)
	sc.Split(sdnotify.ScanFrames)
	var msgs []string
	for sc.Scan() {
		msgs = append(msgs, sc.Text())
		for _, kv := range strings.Split(sc.Text(), "\n") {
			if kv == "READY=1" {
				return msgs
			}
		}
	}
	t.Fatalf("no READY=1 (messages %q): %v", msgs, sc.Err())
	return nil
}

// qmp runs commands on QEMU's monitor: greeting, then one JSON object per line, skipping
// asynchronous events.
func qmp(t *testing.T, sock string, commands ...string) {
	t.Helper()
	c, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	dec := json.NewDecoder(c)
	var greeting map[string]json.RawMessage
	if err := dec.Decode(&greeting); err != nil || greeting["QMP"] == nil {
		t.Fatalf("qmp greeting: %v %v", greeting, err)
	}
	for _, cmd := range commands {
		if _, err := fmt.Fprintf(c, "{\"execute\":%q}\n", cmd); err != nil {
			t.Fatal(err)
		}
		for {
			var resp map[string]json.RawMessage
			if err := dec.Decode(&resp); err != nil {
				t.Fatalf("qmp %s: %v", cmd, err)
			}
			if e, ok := resp["error"]; ok {
				t.Fatalf("qmp %s: %s", cmd, e)
			}
			if _, ok := resp["return"]; ok {
				break
			}
		}
	}
}

// powerDown presses the VM's power button and waits for QEMU to end. This
// file's tests are about what a boot does, not about the button (TestBoot
// is): a press the guest has not acted on within 30s is logged with the
// console's end, and pressed once more, before the test fails.
func powerDown(t *testing.T, qmpSock string, qemu *proc, consoleLog string) {
	t.Helper()
	qmp(t, qmpSock, "qmp_capabilities", "system_powerdown")
	if qemu.wait(30*time.Second) == nil {
		return
	}
	b, _ := os.ReadFile(consoleLog)
	t.Logf("qemu still running 30s after system_powerdown; the console ends:\n%s", tail(b, 25))
	qmp(t, qmpSock, "qmp_capabilities", "system_powerdown")
	if err := qemu.wait(60 * time.Second); err != nil {
		t.Errorf("qemu after a second system_powerdown: %v", err)
	}
}

func tail(b []byte, lines int) string {
	ls := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(ls) > lines {
		ls = ls[len(ls)-lines:]
	}
	return strings.Join(ls, "\n")
}
