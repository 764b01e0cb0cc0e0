package guestapi

import (
	"context"
	"sync"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/grpc"
)

// flakyVerifier is an attestation service that may be down, and that, like
// the real one, refuses nonces to a VM whose boot it was never told about.
type flakyVerifier struct {
	attestationv1.VerifierServiceClient
	mu    sync.Mutex
	down  bool
	boots map[string]uint64
	calls int
}

func (v *flakyVerifier) BeginBoot(_ context.Context, req *attestationv1.BeginBootRequest, _ ...grpc.CallOption) (*attestationv1.Attestation, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.down {
		return nil, apierr.Errorf(apierr.Unavailable, "connection refused")
	}
	v.calls++
	v.boots[req.GetVmId()]++
	return &attestationv1.Attestation{Required: req.GetRequired(), UserDataReleased: !req.GetRequired(), Boot: v.boots[req.GetVmId()]}, nil
}

func (v *flakyVerifier) IssueNonce(_ context.Context, req *attestationv1.IssueNonceRequest, _ ...grpc.CallOption) (*attestationv1.IssueNonceResponse, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.down {
		return nil, apierr.Errorf(apierr.Unavailable, "connection refused")
	}
	if v.boots[req.GetVmId()] == 0 {
		return nil, apierr.Errorf(apierr.NotFound, "vm %q not found", req.GetVmId())
	}
	return &attestationv1.IssueNonceResponse{Nonce: make([]byte, 32), Boot: v.boots[req.GetVmId()]}, nil
}

// A boot launched while attestation was down (the fault suite SIGKILLs it
// while a create runs) is begun at the guest's first nonce request once
// attestation is back; before, attestation refused every nonce of that boot
// and the guest stayed booting until the boot timeout.
func TestBootBegunLateWhenAttestationWasDown(t *testing.T) {
	v := &flakyVerifier{down: true, boots: map[string]uint64{}}
	s, r := newSide(t, v)
	// What a launch records when BeginBoot fails: boot 0, the gate closed.
	_ = r.Update(vmID, func(rec *storepb.VirtualMachine) {
		rec.Attestation = &attestationv1.Attestation{Required: true}
	})
	if _, err := s.IssueNonce(context.Background(), vmID); apierr.CodeOf(err) != apierr.Unavailable {
		t.Fatalf("nonce while attestation is down: %v", err)
	}
	v.mu.Lock()
	v.down = false
	v.mu.Unlock()
	var wg sync.WaitGroup
	for range 4 { // the guest retries; concurrent requests begin the boot once
		wg.Go(func() {
			if _, err := s.IssueNonce(context.Background(), vmID); err != nil {
				t.Errorf("nonce once attestation is back: %v", err)
			}
		})
	}
	wg.Wait()
	rec, _ := r.Record(vmID)
	if v.calls != 1 || rec.GetAttestation().GetBoot() != 1 || rec.GetState() != hypervisorv1.State_STATE_ATTESTING || rec.GetAttestation().GetUserDataReleased() {
		t.Errorf("BeginBoot calls %d, record %v", v.calls, rec)
	}
	// A boot attestation knows is not begun again.
	if _, err := s.IssueNonce(context.Background(), vmID); err != nil || v.calls != 1 {
		t.Errorf("another nonce: %v, BeginBoot calls %d", err, v.calls)
	}
}
