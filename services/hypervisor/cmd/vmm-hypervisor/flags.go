package main

import (
	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/host"
)

// hostFlags defines the flags of the binaries and the firmware a VM runs on
// (--qemu, --qemu-img, --swtpm, --ovmf-code, --ovmf-vars), the same for serve and image
// measure. The function it returns, called once fs is parsed, is them as a
// host.Config.
func hostFlags(fs *cli.FlagSet) func() host.Config {
	qemu := fs.String("qemu", "VM_MANAGER_QEMU", "qemu-system-x86_64", "QEMU binary")
	swtpm := fs.String("swtpm", "VM_MANAGER_SWTPM", "swtpm", "swtpm binary")
	qemuImg := fs.String("qemu-img", "VM_MANAGER_QEMU_IMG", "", "qemu-img binary, which makes the disk overlays of forks (default: the one beside --qemu, else on PATH)")
	ovmfCode := fs.String("ovmf-code", "VM_MANAGER_OVMF_CODE", "", "OVMF code image (default: the first known pair found)")
	ovmfVars := fs.String("ovmf-vars", "VM_MANAGER_OVMF_VARS", "", "OVMF variable store template (default: the pair's VARS file)")
	return func() host.Config {
		return host.Config{QEMUBinary: *qemu, QEMUImgBinary: *qemuImg, SwtpmBinary: *swtpm, OVMFCode: *ovmfCode, OVMFVars: *ovmfVars}
	}
}
