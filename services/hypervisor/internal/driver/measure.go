package driver

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/logtail"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/swtpm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// KernelStarted is the console line that says the firmware has handed over
// to the kernel: by then the firmware, the boot loader and the kernel's EFI
// stub have measured everything they measure, and no firmware PCR changes
// any more.
var KernelStarted = []byte("Linux version ")

// MeasureDiskMiB is the size of a measuring boot's disk: the image's disk
// at its start, as the installer writes it onto a VM's volume.
const MeasureDiskMiB = 1024

// Measure boots a UKI image's installed disk, or an OCI image's boot chain
// with its root attached, once, as a VM's boot runs (the same QEMU devices,
// this host's firmware and a fresh swtpm),
// until the kernel has started, then reads the sha256 PCRs asked for from
// the vTPM. dir is a scratch directory (short: it holds sockets). It is how
// an image's golden firmware PCRs are recorded without a VM of the service.
func (d *Driver) Measure(ctx context.Context, img *hypervisorv1.Image, dir string, pcrs []uint, timeout time.Duration) (map[uint32][]byte, error) {
	kind := img.GetKind()
	if kind != hypervisorv1.ImageKind_IMAGE_KIND_UKI && kind != hypervisorv1.ImageKind_IMAGE_KIND_OCI {
		return nil, fmt.Errorf("image %s is a kernel image: only a UKI image's installed boot and an OCI image's boot are measured", img.GetRef())
	}
	rec := &storepb.VirtualMachine{
		Id: "measure", Cpus: 1, MemoryMib: 512, MachineId: "00000000000000000000000000000000",
		Booted:  true, // not the first boot: no first-boot command line
		Paths:   vm.PathsIn(dir),
		Network: "measure", Mac: "52:54:00:00:00:01",
	}
	rec.Paths.Volume = filepath.Join(dir, "disk.raw")
	if err := d.Prepare(&storepb.VirtualMachine{Paths: &hypervisorv1.Paths{TpmState: rec.Paths.TpmState, OvmfVars: rec.Paths.OvmfVars}}); err != nil {
		return nil, err
	}
	disk := img.GetDisk()
	if kind == hypervisorv1.ImageKind_IMAGE_KIND_OCI {
		disk = os.DevNull // an empty overlay disk, as a new VM's
	}
	if err := copyDisk(disk, rec.Paths.Volume, MeasureDiskMiB<<20); err != nil {
		return nil, fmt.Errorf("the image's disk: %w", err)
	}
	tpmCfg := swtpm.Config{Binary: d.cfg.SwtpmBinary, StateDir: rec.Paths.TpmState, Linger: true}
	tpm, err := swtpm.Start(ctx, tpmCfg)
	if err != nil {
		return nil, err
	}
	defer tpm.Terminate(d.cfg.KillGrace)
	args, err := d.spec(rec, img, hypervisorv1.Phase_PHASE_BOOT).Args()
	if err != nil {
		return nil, err
	}
	qp, mon, err := d.startQEMU(ctx, rec.Paths, args)
	if err != nil {
		return nil, err
	}
	defer qp.Terminate(d.cfg.KillGrace)
	defer mon.Close()

	wait, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	for !consoleHas(rec.Paths.Console, KernelStarted) {
		select {
		case <-qp.Done():
			return nil, fmt.Errorf("qemu ended before the kernel started%s", logtail.WithHeader(rec.Paths.Console, 20, "\nconsole:\n"))
		case <-wait.Done():
			return nil, fmt.Errorf("no %q on the serial console within %s (the image's command line must log the kernel to ttyS0)%s",
				bytes.TrimSpace(KernelStarted), timeout, logtail.WithHeader(rec.Paths.Console, 20, "\nconsole:\n"))
		case <-time.After(100 * time.Millisecond):
		}
	}
	// SIGKILL: an orderly QEMU exit would tell swtpm to shut the TPM down.
	_ = qp.Signal(syscall.SIGKILL)
	<-qp.Done()
	return swtpm.ReadPCRs(ctx, swtpm.Config{StateDir: rec.Paths.TpmState}.WithDefaults().CtrlSocket, pcrs)
}

func consoleHas(path string, marker []byte) bool {
	b, err := os.ReadFile(path)
	return err == nil && bytes.Contains(b, marker)
}

// copyDisk copies src to the start of a sparse file of size bytes. Its
// open, copy and close steps are like guestimage's fetchFile; kept apart: the
// files, flags and checks differ, and the steps are Go's usual ones.
func copyDisk(src, dst string, size int64) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	n, err := io.Copy(out, in)
	if err == nil && n > size {
		err = fmt.Errorf("%s is %d bytes, more than the %d of a measuring boot's disk", src, n, size)
	}
	if err == nil {
		err = out.Truncate(size)
	}
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	return err
}
