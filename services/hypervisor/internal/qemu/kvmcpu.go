package qemu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// KVM CPU models, best first.
const (
	CPUHost = "host"
	// CPUHostNested hides IA32_ARCH_CAPABILITIES: on some nested KVM hosts
	// (a VM running VMs) QEMU 7.2 aborts setting that MSR with -cpu host
	// ("failed to set MSR 0x10a"). The guest then keeps its speculation
	// mitigations on: slower, never wrong.
	CPUHostNested = "host,-arch-capabilities"
)

// KVMProbeTimeout bounds one probe. OVMF writes its first serial bytes after
// ~3.5 s under TCG on a loaded 2-core machine and well under a second under KVM.
const KVMProbeTimeout = 4 * time.Second

// ProbeKVM finds out whether KVM can run a guest here, and with which -cpu
// model: /dev/kvm opening is not enough (on some nested hosts QEMU aborts at
// vCPU creation, or OVMF hangs without a word). Each candidate boots the real
// firmware until it writes to the serial console; the first that does wins.
func ProbeKVM(ctx context.Context, binary, ovmfCode, ovmfVars string) (string, error) {
	dir, err := os.MkdirTemp("", "vmm-kvm-probe-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(dir)
	var errs []error
	for _, cpu := range []string{CPUHost, CPUHostNested} {
		if err := firmwareRuns(ctx, dir, binary, cpu, ovmfCode, ovmfVars); err != nil {
			errs = append(errs, fmt.Errorf("-cpu %s: %w", cpu, err))
			continue
		}
		return cpu, nil
	}
	return "", errors.Join(errs...)
}

func firmwareRuns(ctx context.Context, dir, binary, cpu, code, varsTemplate string) error {
	ctx, cancel := context.WithTimeout(ctx, KVMProbeTimeout)
	defer cancel()
	vars := filepath.Join(dir, "vars.fd")
	b, err := os.ReadFile(varsTemplate)
	if err != nil {
		return err
	}
	if err := os.WriteFile(vars, b, 0o600); err != nil {
		return err
	}
	serial := filepath.Join(dir, "serial.log")
	_ = os.Remove(serial)
	var stderr strings.Builder
	cmd := exec.Command(binary, "-machine", "q35", "-accel", "kvm", "-cpu", cpu, "-m", "256",
		"-nodefaults", "-display", "none", "-monitor", "none", "-serial", "file:"+serial,
		"-drive", "if=pflash,format=raw,unit=0,readonly=on,file="+code,
		"-drive", "if=pflash,format=raw,unit=1,file="+vars)
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		_ = cmd.Process.Kill()
		<-exited
	}()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case err := <-exited:
			exited <- err // for the deferred wait
			return fmt.Errorf("qemu exited (%v): %s", err, firstLine(strings.TrimSpace(stderr.String())))
		case <-ctx.Done():
			return fmt.Errorf("the firmware wrote nothing within %s", KVMProbeTimeout)
		case <-tick.C:
			if fi, err := os.Stat(serial); err == nil && fi.Size() > 0 {
				return nil
			}
		}
	}
}
