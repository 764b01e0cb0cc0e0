package qemu

import (
	"context"
	"os"
	"os/exec"
	"testing"
)

// TestProbeKVM checks the probe's verdict against a boot it did not see: a
// chosen model must boot the firmware again, and a rejection must hold for
// every model.
func TestProbeKVM(t *testing.T) {
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		t.Skip("qemu-system-x86_64 not installed")
	}
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		t.Skip("no usable /dev/kvm: the probe only runs under KVM")
	}
	f.Close()
	code, vars := "/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd"
	if _, err := os.Stat(code); err != nil {
		t.Skip("OVMF not installed")
	}
	ctx := context.Background()
	cpu, err := ProbeKVM(ctx, "qemu-system-x86_64", code, vars)
	t.Logf("probe: cpu %q, err %v", cpu, err)
	dir := t.TempDir()
	if err == nil {
		if ferr := firmwareRuns(ctx, dir, "qemu-system-x86_64", cpu, code, vars); ferr != nil {
			t.Fatalf("probe chose %q, which does not boot: %v", cpu, ferr)
		}
		return
	}
	for _, c := range []string{CPUHost, CPUHostNested} {
		if firmwareRuns(ctx, dir, "qemu-system-x86_64", c, code, vars) == nil {
			t.Fatalf("probe rejected KVM, but -cpu %s boots", c)
		}
	}
}
