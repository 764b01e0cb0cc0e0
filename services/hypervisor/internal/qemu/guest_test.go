package qemu

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/notify"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/swtpm"
)

// TestGuestBootReadyAndPowerdown boots the project's test guest when
// VMM_TEST_GUEST names one (a path prefix with .vmlinuz, .initrd and
// optionally .cmdline, as `make` builds it): READY=1 must arrive over the
// virtio-serial notify port, and ACPI power-down must end QEMU.
func TestGuestBootReadyAndPowerdown(t *testing.T) {
	prefix := os.Getenv("VMM_TEST_GUEST")
	if prefix == "" {
		t.Skip("VMM_TEST_GUEST is not set (path prefix of a test guest's .vmlinuz/.initrd)")
	}
	f := newVM(t)
	cmdline := "console=ttyS0 panic=-1"
	if b, err := os.ReadFile(prefix + ".cmdline"); err == nil {
		cmdline = strings.TrimSpace(string(b))
	}
	// Copies: the image may be rebuilt while the test runs.
	copyFile(t, prefix+".vmlinuz", filepath.Join(f.dir, "vmlinuz"))
	copyFile(t, prefix+".initrd", filepath.Join(f.dir, "initrd"))

	cfg := swtpm.Config{StateDir: filepath.Join(f.dir, "tpm")}.WithDefaults()
	tpm, err := swtpm.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tpm.Terminate(swtpm.StopGrace) })

	// VMM_TEST_ACCEL=kvm with VMM_TEST_CPU (e.g. "host"); default TCG.
	if a := os.Getenv("VMM_TEST_ACCEL"); a != "" {
		f.spec.Accel = a
	}
	f.spec.CPU = os.Getenv("VMM_TEST_CPU")
	f.spec.MemoryMiB = 512
	f.spec.Boot = BootKernel
	f.spec.Kernel = filepath.Join(f.dir, "vmlinuz")
	f.spec.Initrd = filepath.Join(f.dir, "initrd")
	f.spec.Cmdline = cmdline
	f.spec.SwtpmSocket = cfg.CtrlSocket
	f.spec.NotifySocket = filepath.Join(f.dir, "notify.sock")
	f.spec.Credentials = map[string]string{"firstboot.hostname": "guest-test"}

	r := notify.NewRouter()
	msgs, unsubscribe := r.Subscribe(f.spec.ID)
	defer unsubscribe()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go r.AttachSerial(ctx, f.spec.ID, f.spec.NotifySocket)

	t0 := time.Now()
	p, m := f.start(t)
	timeout := time.After(60 * time.Second)
	for ready := false; !ready; {
		select {
		case msg := <-msgs:
			t.Logf("%6.2fs notify %v privileged=%v", time.Since(t0).Seconds(), msg.Fields, msg.Privileged)
			ready = msg.Ready
		case <-timeout:
			b, _ := os.ReadFile(f.spec.ConsoleLog)
			t.Fatalf("no READY=1 within 60 s (accel %s); console:\n%s", f.spec.Accel, b)
		}
	}
	t.Logf("start to READY=1: %v (accel %s)", time.Since(t0), f.spec.Accel)

	t1 := time.Now()
	if err := m.Powerdown(ctxT(t, 10*time.Second)); err != nil {
		t.Fatal(err)
	}
	e := nextEvent(t, m, "SHUTDOWN", 30*time.Second)
	waitExit(t, p, 30*time.Second)
	t.Logf("power-down to exit: %v (SHUTDOWN %v)", time.Since(t1), e.Data)
	waitExit(t, tpm, 10*time.Second)
}
