package vm

import (
	"context"
	"sync"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/notify"
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
	m2, err := assemble(Config{StateDir: t.TempDir()}, m.log, st, images2{}, v, notify.NewRouter(), newFakeDriver())
	if err != nil {
		t.Fatal(err)
	}
	m2.RunLoops()
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
