package vm

import (
	"context"
	"errors"
	"strings"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
)

// An installer that powers off hands over to the installed boot only when
// the host finds the image's disk on the volume.
func TestInstallIsVerified(t *testing.T) {
	for _, bad := range []error{nil, errors.New("the volume differs from the image's disk /u.raw at byte 512")} {
		h := newHarness(t)
		h.drv.badInstall = bad
		v, err := h.m.Create(context.Background(), &hypervisorv1.CreateVirtualMachineRequest{Name: "os", Image: "os_1", RequireAttestation: new(true),
			MemoryMib: new(int32(512)), Cpus: new(int32(1)), WaitFor: hypervisorv1.WaitFor_WAIT_FOR_NONE}, "tester")
		if err != nil {
			t.Fatal(err)
		}
		v = h.waitFor(v.GetId(), func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_INSTALLING })
		r := h.drv.run(v.GetId())
		r.shutdowns <- Shutdown{Guest: true}
		r.exit(0)
		if bad == nil {
			v = h.waitFor(v.GetId(), func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_BOOTING })
			if v.GetInstalledAt() == nil || h.drv.launchCount() != 2 {
				t.Errorf("after a verified install: %v, %d launches", v, h.drv.launchCount())
			}
		} else {
			v = h.waitFor(v.GetId(), func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_FAILED })
			if !strings.HasPrefix(v.GetLastError(), "the install does not verify: the volume differs") || v.GetInstalledAt() != nil || h.drv.launchCount() != 1 {
				t.Errorf("after a bad install: lastError %q, installedAt %v, %d launches", v.GetLastError(), v.GetInstalledAt(), h.drv.launchCount())
			}
		}
		h.drv.mu.Lock()
		if h.drv.verified != 1 {
			t.Errorf("VerifyInstall ran %d times", h.drv.verified)
		}
		h.drv.mu.Unlock()
	}
}

// An installer that fails resets the machine (QEMU, under -no-reboot, then
// exits 0): the VM fails, and the empty volume is never booted.
func TestInstallerResetFails(t *testing.T) {
	h := newHarness(t)
	v, err := h.m.Create(context.Background(), &hypervisorv1.CreateVirtualMachineRequest{Name: "os", Image: "os_1", RequireAttestation: new(true),
		MemoryMib: new(int32(512)), Cpus: new(int32(1)), WaitFor: hypervisorv1.WaitFor_WAIT_FOR_NONE}, "tester")
	if err != nil {
		t.Fatal(err)
	}
	v = h.waitFor(v.GetId(), func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_INSTALLING })
	h.drv.run(v.GetId()).reset()
	v = h.waitFor(v.GetId(), func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_FAILED })
	if !strings.HasPrefix(v.GetLastError(), "the installer failed: it reset the machine") || v.GetInstalledAt() != nil || h.drv.launchCount() != 1 {
		t.Errorf("lastError %q, installedAt %v, %d launches", v.GetLastError(), v.GetInstalledAt(), h.drv.launchCount())
	}
	h.drv.mu.Lock()
	defer h.drv.mu.Unlock()
	if h.drv.verified != 0 {
		t.Errorf("a reset install was verified %d times", h.drv.verified)
	}
}
