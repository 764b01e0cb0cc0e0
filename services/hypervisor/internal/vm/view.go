package vm

import (
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/vtpm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"github.com/google/go-tpm/tpm2"
	"google.golang.org/protobuf/proto"
)

// View is the API's VirtualMachine of a stored record: the original's fields
// and the documented additions (accelerator, createdBy, forwards, tpm,
// bootCount). Process start times and raw TPM material stay in the record.
func View(rec *storepb.VirtualMachine) *hypervisorv1.VirtualMachine {
	if rec == nil {
		return nil
	}
	clone := func(m proto.Message) proto.Message { return proto.Clone(m) }
	v := &hypervisorv1.VirtualMachine{
		Id:                 rec.GetId(),
		Name:               rec.GetName(),
		Image:              rec.GetImage(),
		KubernetesVersion:  rec.GetKubernetesVersion(),
		Cpus:               rec.GetCpus(),
		MemoryMib:          rec.GetMemoryMib(),
		DiskGib:            rec.GetDiskGib(),
		Network:            rec.GetNetwork(),
		SshAuthorizedKeys:  append([]string(nil), rec.GetSshAuthorizedKeys()...),
		Hostname:           rec.GetHostname(),
		Region:             rec.GetRegion(),
		Zone:               rec.GetZone(),
		RequireAttestation: rec.GetRequireAttestation(),
		State:              rec.GetState(),
		Phase:              rec.GetPhase(),
		Ip:                 rec.GetIp(),
		Mac:                rec.GetMac(),
		Cid:                rec.GetCid(),
		MachineId:          rec.GetMachineId(),
		Booted:             rec.GetBooted(),
		Status:             rec.GetStatus(),
		SshPublicKey:       rec.GetSshPublicKey(),
		Accelerator:        rec.GetAccelerator(),
		CreatedAt:          rec.GetCreatedAt(),
		InstalledAt:        rec.GetInstalledAt(),
		BootedAt:           rec.GetBootedAt(),
		ReadyAt:            rec.GetReadyAt(),
		LastError:          rec.GetLastError(),
		CreatedBy:          rec.GetCreatedBy(),
		BootCount:          rec.GetBootCount(),
		Tpm:                tpmIdentity(rec.GetTpm()),
		FromPool:           rec.GetFromPool(),
		ClaimedAt:          rec.GetClaimedAt(),
		ForkedFrom:         rec.GetForkedFrom(),
	}
	if lt := rec.GetLifetime(); lt != nil {
		v.Lifetime = clone(lt).(*hypervisorv1.Lifetime)
	}
	if oi := rec.GetOciImage(); oi != nil {
		v.OciImage = clone(oi).(*hypervisorv1.OciImageRef)
	}
	if md := rec.GetMetadata(); md != nil {
		v.Metadata = make(map[string]string, len(md))
		for k, val := range md {
			v.Metadata[k] = val
		}
	}
	// attestation and paths are objects the original always wrote (they are
	// REQUIRED): before the first boot's summary, the empty one.
	v.Attestation = &attestationv1.Attestation{Required: rec.GetRequireAttestation()}
	if a := rec.GetAttestation(); a != nil {
		v.Attestation = clone(a).(*attestationv1.Attestation)
	}
	v.Paths = &hypervisorv1.Paths{}
	if p := rec.GetPaths(); p != nil {
		v.Paths = clone(p).(*hypervisorv1.Paths)
	}
	for _, f := range rec.GetForwards() {
		v.Forwards = append(v.Forwards, clone(f).(*hypervisorv1.PortForward))
	}
	if p := rec.GetProcesses(); p != nil {
		v.Processes = &hypervisorv1.Processes{Qemu: process(p.GetQemu()), Tpm: process(p.GetTpm())}
	}
	return v
}

func process(p *storepb.Process) *hypervisorv1.Process {
	if p == nil {
		return nil
	}
	return &hypervisorv1.Process{Pid: p.GetPid(), Unit: p.GetUnit()}
}

// tpmIdentity derives the published identity from the stored keys.
func tpmIdentity(k *storepb.TpmKeys) *hypervisorv1.TpmIdentity {
	if k == nil {
		return nil
	}
	id := &hypervisorv1.TpmIdentity{
		EkPublic:      publicPEM(k.GetEkPublic()),
		EkFingerprint: vtpm.Fingerprint(k.GetEkPublic()),
		AkPublic:      publicPEM(k.GetAkPublic()),
		AkFingerprint: vtpm.Fingerprint(k.GetAkPublic()),
		AkName:        hex.EncodeToString(k.GetAkName()),
		ProvisionTime: k.GetProvisionTime(),
		UpdateTime:    k.GetUpdateTime(),
	}
	if c := k.GetEkCertificate(); len(c) > 0 {
		id.EkCertificate = string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c}))
	}
	return id
}

// publicPEM is a TPMT_PUBLIC's key as PKIX PEM; empty when it does not parse.
func publicPEM(tpmtPublic []byte) string {
	pub, err := tpm2.Unmarshal[tpm2.TPMTPublic](tpmtPublic)
	if err != nil {
		return ""
	}
	key, err := tpm2.Pub(*pub)
	if err != nil {
		return ""
	}
	der, err := x509.MarshalPKIXPublicKey(key)
	if err != nil {
		return ""
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}))
}
