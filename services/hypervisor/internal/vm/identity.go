package vm

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/gen/vtpm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/swtpm"
	"github.com/google/go-tpm/tpm2"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// This file is the VM's vTPM identity: the keys the host provisions in the
// vTPM before the guest runs, and the boot registration that tells
// attestation which key's quotes count. Nothing the guest sends decides
// which key that is.

// provisionTPM reads the VM's EK and AK from its vTPM, making whatever is
// missing or does not match its template, before a launch: no QEMU holds the
// state then. It returns the record's identity, updated where a key changed.
func (m *Manager) provisionTPM(ctx context.Context, rec *hypervisorv1.VirtualMachine) (*hypervisorv1.TpmIdentity, error) {
	id, err := swtpm.Provision(ctx, swtpm.Config{Binary: m.cfg.SwtpmBinary, StateDir: rec.GetPaths().GetTpmState()}, m.cfg.VTPMCA, rec.GetId())
	if err != nil {
		return nil, fmt.Errorf("provision the vTPM: %w", err)
	}
	next, err := identityRecord(rec.GetTpm(), id, time.Now())
	if err != nil {
		return nil, err
	}
	if len(id.Created) > 0 {
		level := m.log.Info
		if rec.GetTpm() != nil {
			// The keys were there at the last boot: the guest removed or replaced them.
			level = m.log.Warn
		}
		level("vTPM provisioned", "vm", rec.GetId(), "created", id.Created, "ak", next.GetAkFingerprint()[:16])
	}
	return next, nil
}

// identityRecord is the record's view of a provisioned identity; the times
// say when it was first made and when it last changed.
func identityRecord(old *hypervisorv1.TpmIdentity, id *swtpm.Identity, now time.Time) (*hypervisorv1.TpmIdentity, error) {
	ekPEM, err := publicPEM(id.EK.Parsed)
	if err != nil {
		return nil, fmt.Errorf("endorsement key: %w", err)
	}
	akPEM, err := publicPEM(id.AK.Parsed)
	if err != nil {
		return nil, fmt.Errorf("attestation key: %w", err)
	}
	out := &hypervisorv1.TpmIdentity{
		EkPublic:      ekPEM,
		EkFingerprint: vtpm.Fingerprint(id.EK.Public),
		AkPublic:      akPEM,
		AkFingerprint: vtpm.Fingerprint(id.AK.Public),
		AkName:        hex.EncodeToString(id.AK.Name.Buffer),
		AkTpmtPublic:  bytes.Clone(id.AK.Public),
		EkTpmtPublic:  bytes.Clone(id.EK.Public),
		ProvisionTime: old.GetProvisionTime(),
		UpdateTime:    old.GetUpdateTime(),
	}
	if id.EKCertificate != nil {
		out.EkCertificate = string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: id.EKCertificate}))
	}
	if out.ProvisionTime == nil {
		out.ProvisionTime = timestamppb.New(now)
	}
	if old == nil || old.GetAkFingerprint() != out.AkFingerprint || old.GetEkFingerprint() != out.EkFingerprint || old.GetEkCertificate() != out.EkCertificate {
		out.UpdateTime = timestamppb.New(now)
	}
	return out, nil
}

func publicPEM(pub tpm2.TPMTPublic) (string, error) {
	key, err := tpm2.Pub(pub)
	if err != nil {
		return "", err
	}
	der, err := x509.MarshalPKIXPublicKey(key)
	if err != nil {
		return "", err
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der})), nil
}

// directKernel says whether the VM's image boots a kernel directly (PCR 9
// then holds its initrd and command line and is golden). Only UKI images
// have a volume, which decides when the image has left the catalog.
func (m *Manager) directKernel(rec *hypervisorv1.VirtualMachine) bool {
	if img, err := m.images.Get(rec.GetImage()); err == nil {
		return img.GetKind() == hypervisorv1.ImageKind_IMAGE_KIND_KERNEL
	}
	return rec.GetPaths().GetVolume() == ""
}

// beginBoot registers a new boot, with the key provisioned for it, before
// QEMU starts: no IMDS request of the new boot can see the previous boot's
// gate. Attestation being down must not stop a boot whose user-data is not
// gated: the record then says boot 0 and the guest's first nonce request
// registers it (beginLate).
func (m *Manager) beginBoot(rec *hypervisorv1.VirtualMachine) *attestationv1.Attestation {
	local := &attestationv1.Attestation{Required: rec.GetRequireAttestation(), UserDataReleased: !rec.GetRequireAttestation()}
	if m.verifier == nil {
		return local
	}
	ctx, cancel := context.WithTimeout(m.ctx, 5*time.Second)
	defer cancel()
	att, err := m.verifier.BeginBoot(ctx, m.beginBootRequest(rec))
	if err != nil {
		m.log.Warn("attestation did not record the boot; the guest's first nonce request will", "vm", rec.GetId(), "error", err)
		return local
	}
	return att
}

func (m *Manager) beginBootRequest(rec *hypervisorv1.VirtualMachine) *attestationv1.BeginBootRequest {
	return &attestationv1.BeginBootRequest{
		VmId: rec.GetId(), Image: rec.GetImage(), KubernetesVersion: rec.GetKubernetesVersion(), Required: rec.GetRequireAttestation(),
		Firmware:     &attestationv1.FirmwareBuild{Sha256: m.cfg.Firmware.GetSha256(), Package: m.cfg.Firmware.GetPackage(), Version: m.cfg.Firmware.GetVersion()},
		AkPublic:     rec.GetTpm().GetAkTpmtPublic(),
		EkPublic:     rec.GetTpm().GetEkTpmtPublic(),
		DirectKernel: m.directKernel(rec),
	}
}
