package gate

import (
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
)

func TestNewBoot(t *testing.T) {
	if a := NewBoot(true); !a.GetRequired() || a.GetUserDataReleased() {
		t.Errorf("required: %v", a)
	}
	if a := NewBoot(false); a.GetRequired() || !a.GetUserDataReleased() {
		t.Errorf("not required: %v", a)
	}
}

func TestReleases(t *testing.T) {
	closed, open := NewBoot(true), NewBoot(false)
	initrd, ready := attestationv1.Stage_STAGE_INITRD, attestationv1.Stage_STAGE_READY
	for _, c := range []struct {
		name     string
		att      *attestationv1.Attestation
		stage    attestationv1.Stage
		verified bool
		want     bool
	}{
		{"verified initrd quote", closed, initrd, true, true},
		{"rejected initrd quote", closed, initrd, false, false},
		{"verified ready quote", closed, ready, true, false},
		{"already open", open, initrd, true, false},
	} {
		if got := Releases(c.att, c.stage, c.verified); got != c.want {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}

func TestSummary(t *testing.T) {
	rejected := &attestationv1.Attestation{Initrd: &attestationv1.Quote{Verified: false}}
	for _, c := range []struct {
		required bool
		att      *attestationv1.Attestation
		want     hypervisorv1.AttestationState
	}{
		{false, nil, hypervisorv1.AttestationState_ATTESTATION_STATE_DISABLED},
		{true, nil, hypervisorv1.AttestationState_ATTESTATION_STATE_PENDING},
		{true, NewBoot(true), hypervisorv1.AttestationState_ATTESTATION_STATE_PENDING},
		{true, &attestationv1.Attestation{UserDataReleased: true}, hypervisorv1.AttestationState_ATTESTATION_STATE_RELEASED},
		{true, rejected, hypervisorv1.AttestationState_ATTESTATION_STATE_FAILED},
	} {
		if got := Summary(c.required, c.att); got != c.want {
			t.Errorf("required %v, %v: %v, want %v", c.required, c.att, got, c.want)
		}
	}
}
