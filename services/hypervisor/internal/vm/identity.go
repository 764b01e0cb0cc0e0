package vm

import (
	"context"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/gate"
	"github.com/giantswarm/vm-manager/pkg/vtpm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/qemu"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// Boots says how a VM's boot is registered with attestation: its image, the
// firmware, the key the host provisioned, what its command line gets.
type Boots struct {
	firmware *hypervisorv1.Firmware
	images   ImageResolver
}

// NewBoots registers boots on firmware, of the images' VMs.
func NewBoots(firmware *hypervisorv1.Firmware, images ImageResolver) *Boots {
	return &Boots{firmware: firmware, images: images}
}

// This file is the VM's vTPM identity: the keys the host provisions in the
// vTPM before the guest runs, and the boot registration that tells
// attestation which key's quotes count. Nothing the guest sends decides
// which key that is.

// provisionTPM has the driver read the VM's EK and AK from its vTPM before a
// launch (making whatever is missing or does not match its template) and
// returns the record's keys.
func (rn *Runner) provisionTPM(ctx context.Context, rec *storepb.VirtualMachine) (*storepb.TpmKeys, error) {
	keys, created, err := rn.driver.Provision(ctx, rec)
	if err != nil {
		return nil, err
	}
	if len(created) > 0 {
		level := rn.log.Info
		if rec.GetTpm() != nil {
			// The keys were there at the last boot: the guest removed or replaced them.
			level = rn.log.Warn
		}
		level("vTPM provisioned", "vm", rec.GetId(), "created", created, "ak", vtpm.Fingerprint(keys.GetAkPublic())[:16])
	}
	return keys, nil
}

// directKernel says whether the VM's image boots a kernel directly (PCR 9
// then holds its initrd and command line and is golden): kernel and OCI
// images. When the image has left the catalog the record decides: an OCI
// image's VM names it, and of the rest only UKI images have a volume.
func (bt *Boots) directKernel(rec *storepb.VirtualMachine) bool {
	if img, err := bt.images.Get(rec.GetImage()); err == nil {
		k := img.GetKind()
		return k == hypervisorv1.ImageKind_IMAGE_KIND_KERNEL || k == hypervisorv1.ImageKind_IMAGE_KIND_OCI
	}
	return rec.GetOciImage() != nil || rec.GetPaths().GetVolume() == ""
}

// beginBoot registers a new boot, with the key provisioned for it, before
// QEMU starts: no IMDS request of the new boot can see the previous boot's
// gate. Attestation being down must not stop a boot whose user-data is not
// gated: the record then says boot 0 and the guest's first nonce request
// registers it (beginLate). ctx is the launch's: the hypervisor's, in the
// trace of the call that started the boot.
func (rn *Runner) beginBoot(ctx context.Context, rec *storepb.VirtualMachine) *attestationv1.Attestation {
	local := gate.NewBoot(rec.GetRequireAttestation())
	if rn.verifier == nil {
		return local
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	att, err := rn.verifier.BeginBoot(ctx, rn.boots.BeginBootRequest(rec))
	if err != nil {
		rn.log.Warn("attestation did not record the boot; the guest's first nonce request will", "vm", rec.GetId(), "error", err)
		return local
	}
	return att
}

// BeginBootRequest registers a VM's current boot with attestation: its
// image, the firmware, and the key the host provisioned in its vTPM.
func (bt *Boots) BeginBootRequest(rec *storepb.VirtualMachine) *attestationv1.BeginBootRequest {
	return &attestationv1.BeginBootRequest{
		VmId: rec.GetId(), Image: rec.GetImage(), KubernetesVersion: rec.GetKubernetesVersion(), Required: rec.GetRequireAttestation(),
		Firmware:     &attestationv1.FirmwareBuild{Sha256: bt.firmware.GetSha256(), Package: bt.firmware.GetPackage(), Version: bt.firmware.GetVersion()},
		AkPublic:     rec.GetTpm().GetAkPublic(),
		EkPublic:     rec.GetTpm().GetEkPublic(),
		DirectKernel: bt.directKernel(rec),
		// The driver passes ignition.firstboot to a UKI image's boots until
		// one was ready (qemu.Spec.FirstBoot); systemd-stub measures it.
		KernelCmdlineExtra: bt.cmdlineExtra(rec),
		// A fork's first boot is its parent's, continued in a vTPM of its own.
		ForkedFrom: forkedFrom(rec),
	}
}

func forkedFrom(rec *storepb.VirtualMachine) string {
	if rec.GetBootCount() == 0 {
		return rec.GetForkedFrom()
	}
	return ""
}

// cmdlineExtra is what the next boot's systemd-stub appends from SMBIOS.
func (bt *Boots) cmdlineExtra(rec *storepb.VirtualMachine) string {
	if bt.directKernel(rec) || rec.GetBooted() {
		return ""
	}
	return qemu.FirstBootExtra
}
