package vm

import (
	"testing"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// TestViewWritesRequiredObjects: a record before its first boot (no
// attestation summary yet) still has the attestation and paths objects the
// original always wrote.
func TestViewWritesRequiredObjects(t *testing.T) {
	v := View(&storepb.VirtualMachine{Id: "0a1b2c3d", RequireAttestation: true})
	if v.GetAttestation() == nil || !v.GetAttestation().GetRequired() || v.GetAttestation().GetUserDataReleased() {
		t.Errorf("attestation = %v, want required and not released", v.GetAttestation())
	}
	if v.GetPaths() == nil {
		t.Error("paths = nil")
	}
}
