// Package gate is the user-data gate's rule, written once. Attestation owns
// the gate: it decides, per boot, whether the boot's user-data is released.
// The hypervisor keeps a cache of those verdicts on its VM records (and
// starts each boot's cache with NewBoot, as attestation starts the boot), and
// the hypervisor's metrics and the gateway summarise them with Summary.
package gate

import (
	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
)

// NewBoot is a boot's attestation before any quote: without required
// attestation the user-data is released at once, with it only by the boot's
// verified initrd quote (Releases).
func NewBoot(required bool) *attestationv1.Attestation {
	return &attestationv1.Attestation{Required: required, UserDataReleased: !required}
}

// Releases says whether a quote opens the gate of the boot att describes: a
// verified quote of the initrd stage, on a boot whose gate is still closed.
// A ready-stage quote never does: user-data is what the initrd fetches.
func Releases(att *attestationv1.Attestation, stage attestationv1.Stage, verified bool) bool {
	return stage == attestationv1.Stage_STAGE_INITRD && verified && !att.GetUserDataReleased()
}

// Summary is the gate as the host reports it: disabled (not required),
// released, failed (the initrd quote was rejected) or pending.
func Summary(required bool, att *attestationv1.Attestation) hypervisorv1.AttestationState {
	switch {
	case !required:
		return hypervisorv1.AttestationState_ATTESTATION_STATE_DISABLED
	case att.GetUserDataReleased():
		return hypervisorv1.AttestationState_ATTESTATION_STATE_RELEASED
	case att.GetInitrd() != nil && !att.GetInitrd().GetVerified():
		return hypervisorv1.AttestationState_ATTESTATION_STATE_FAILED
	default:
		return hypervisorv1.AttestationState_ATTESTATION_STATE_PENDING
	}
}
