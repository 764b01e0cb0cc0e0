package enumname_test

import (
	"slices"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/enumname"
)

func TestOf(t *testing.T) {
	for _, c := range []struct{ got, want string }{
		{enumname.Of(hypervisorv1.State_STATE_READY), "ready"},
		{enumname.Of(hypervisorv1.ImageKind_IMAGE_KIND_KERNEL), "kernel"},
		{enumname.Of(hypervisorv1.AttestationState_ATTESTATION_STATE_RELEASED), "released"},
		{enumname.Of(hypervisorv1.WaitFor_WAIT_FOR_ATTESTED), "attested"},
		{enumname.Of(attestationv1.Mode_MODE_NOOP), "noop"},
		{enumname.Of(attestationv1.Stage_STAGE_INITRD), "initrd"},
		{enumname.Of(hypervisorv1.State_STATE_UNSPECIFIED), "unspecified"},
		{enumname.Of(hypervisorv1.State(99)), "99"},
	} {
		if c.got != c.want {
			t.Errorf("got %q, want %q", c.got, c.want)
		}
	}
}

func TestPrefix(t *testing.T) {
	if got := enumname.Prefix(hypervisorv1.AttestationState(0).Descriptor()); got != "ATTESTATION_STATE_" {
		t.Errorf("Prefix(AttestationState) = %q", got)
	}
}

func TestNames(t *testing.T) {
	want := []string{"creating", "installing", "booting", "attesting", "ready", "running", "stopping", "stopped", "failed", "deleting", "suspending", "suspended"}
	if got := enumname.Names(hypervisorv1.State(0).Descriptor()); !slices.Equal(got, want) {
		t.Errorf("Names(State) = %q, want %q", got, want)
	}
	if got := enumname.Names(hypervisorv1.AttestationState(0).Descriptor()); !slices.Equal(got, []string{"disabled", "pending", "released", "failed"}) {
		t.Errorf("Names(AttestationState) = %q", got)
	}
}
