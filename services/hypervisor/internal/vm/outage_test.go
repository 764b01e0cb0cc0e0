package vm

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/gen/apierr"
	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/notify"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/store/storepb"
	"google.golang.org/grpc"
)

// flakyVerifier is an attestation service that may be down, and that, like
// the real one, refuses nonces to a VM whose boot it was never told about.
type flakyVerifier struct {
	attestationv1.VerifierServiceClient
	mu        sync.Mutex
	down      bool
	boots     map[string]uint64
	calls     int
	forgotten []string
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
	m, mc := newTestManager(t, v)
	rec, _ := mc.snapshot()
	att := m.beginBoot(rec) // what launch records
	if att.GetBoot() != 0 || att.GetUserDataReleased() {
		t.Fatalf("launch without attestation: %v", att)
	}
	m.update(mc, func(r *storepb.VirtualMachine) { r.Phase, r.Attestation = hypervisorv1.Phase_PHASE_BOOT, att })

	if _, err := m.IssueNonce(context.Background(), mc.id); apierr.CodeOf(err) != apierr.Unavailable {
		t.Fatalf("nonce while attestation is down: %v", err)
	}
	v.mu.Lock()
	v.down = false
	v.mu.Unlock()
	var wg sync.WaitGroup
	for range 4 { // the guest retries; concurrent requests begin the boot once
		wg.Go(func() {
			if _, err := m.IssueNonce(context.Background(), mc.id); err != nil {
				t.Errorf("nonce once attestation is back: %v", err)
			}
		})
	}
	wg.Wait()
	rec, _ = mc.snapshot()
	if v.calls != 1 || rec.GetAttestation().GetBoot() != 1 || rec.GetState() != hypervisorv1.State_STATE_ATTESTING || rec.GetAttestation().GetUserDataReleased() {
		t.Errorf("BeginBoot calls %d, record %v", v.calls, rec)
	}
	// A boot attestation knows is not begun again.
	if _, err := m.IssueNonce(context.Background(), mc.id); err != nil || v.calls != 1 {
		t.Errorf("another nonce: %v, BeginBoot calls %d", err, v.calls)
	}
}

func (v *flakyVerifier) ForgetVirtualMachine(_ context.Context, req *attestationv1.ForgetVirtualMachineRequest, _ ...grpc.CallOption) (*attestationv1.ForgetVirtualMachineResponse, error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.down {
		return nil, apierr.Errorf(apierr.Unavailable, "connection refused")
	}
	delete(v.boots, req.GetVmId())
	v.forgotten = append(v.forgotten, req.GetVmId())
	return &attestationv1.ForgetVirtualMachineResponse{}, nil
}

// A VM deleted while attestation is down (the fault suite found its AK pin,
// nonces and verdicts left there for good) stays queued in the store and is
// forgotten once attestation is back, also by the next hypervisor.
func TestDeleteForgetsOnceAttestationIsBack(t *testing.T) {
	v := &flakyVerifier{down: true, boots: map[string]uint64{"0a0b0c0d": 1}}
	m, mc := newTestManager(t, v)
	if err := m.store.PutVM(mc.rec); err != nil {
		t.Fatal(err)
	}
	if err := m.Delete(context.Background(), mc.id); err != nil {
		t.Fatalf("delete while attestation is down: %v", err)
	}
	if ids, _ := m.store.PendingForgets(); len(ids) != 1 || ids[0] != mc.id {
		t.Fatalf("queued forgets %v", ids)
	}
	// The hypervisor restarts; attestation comes back.
	st := m.store
	m.Close()
	v.mu.Lock()
	v.down = false
	v.mu.Unlock()
	m2, err := New(Config{StateDir: t.TempDir()}, m.log, st, images2{}, v, notify.NewRouter())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m2.Close)
	deadline := time.Now().Add(3 * forgetRetry)
	for {
		ids, _ := st.PendingForgets()
		v.mu.Lock()
		forgotten, known := v.forgotten, v.boots[mc.id]
		v.mu.Unlock()
		if len(ids) == 0 && len(forgotten) == 1 && known == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("queued %v, forgotten %v", ids, forgotten)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
