package apiserver

import (
	"runtime"
	"sync"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	"google.golang.org/protobuf/proto"
)

func TestVirtualMachineAttestation(t *testing.T) {
	s, _, _ := newServer(t, tempDB(t), Options{})
	for _, id := range []string{"0000abcd", "", "ABCDEF12", "abc", "0000abcde", "../../x"} {
		_, err := s.GetVirtualMachineAttestation(ctx, &attestationv1.GetVirtualMachineAttestationRequest{Id: id})
		wantCode(t, err, apierr.NotFound)
	}

	a1, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: "0000abcd", Image: img, KubernetesVersion: "v1.33.1", Required: true})
	if err != nil {
		t.Fatalf("BeginBoot: %v", err)
	}
	if a1.GetBoot() != 1 || !a1.GetRequired() || a1.GetUserDataReleased() {
		t.Errorf("first boot = %v", a1)
	}
	got, err := s.GetVirtualMachineAttestation(ctx, &attestationv1.GetVirtualMachineAttestationRequest{Id: "0000abcd"})
	if err != nil || !proto.Equal(got, a1) {
		t.Errorf("Get after BeginBoot = %v %v, want %v", got, err, a1)
	}

	a2, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: "0000abcd", Image: img, Required: false})
	if err != nil {
		t.Fatal(err)
	}
	if a2.GetBoot() != 2 || a2.GetRequired() || !a2.GetUserDataReleased() {
		t.Errorf("second boot = %v", a2)
	}
	if a2.GetInitrd() != nil || a2.GetReady() != nil {
		t.Errorf("new boot carries old verdicts")
	}

	// Another VM has its own counter.
	b1, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: "0000beef", Image: img})
	if err != nil || b1.GetBoot() != 1 {
		t.Errorf("other vm first boot = %v %v", b1, err)
	}

	for _, bad := range []*attestationv1.BeginBootRequest{
		{VmId: "nothex!!", Image: img},
		{VmId: "0000abcd", Image: "noversion"},
	} {
		_, err := s.BeginBoot(ctx, bad)
		wantCode(t, err, apierr.InvalidRequest)
	}
	// A refused BeginBoot did not bump the boot.
	got, _ = s.GetVirtualMachineAttestation(ctx, &attestationv1.GetVirtualMachineAttestationRequest{Id: "0000abcd"})
	if got.GetBoot() != 2 {
		t.Errorf("boot after refused BeginBoot = %d", got.GetBoot())
	}

	if _, err := s.ForgetVirtualMachine(ctx, &attestationv1.ForgetVirtualMachineRequest{VmId: "0000abcd"}); err != nil {
		t.Fatalf("Forget: %v", err)
	}
	_, err = s.GetVirtualMachineAttestation(ctx, &attestationv1.GetVirtualMachineAttestationRequest{Id: "0000abcd"})
	wantCode(t, err, apierr.NotFound)
	// Forgetting twice is fine, and the other VM is untouched.
	if _, err := s.ForgetVirtualMachine(ctx, &attestationv1.ForgetVirtualMachineRequest{VmId: "0000abcd"}); err != nil {
		t.Errorf("second Forget: %v", err)
	}
	if _, err := s.GetVirtualMachineAttestation(ctx, &attestationv1.GetVirtualMachineAttestationRequest{Id: "0000beef"}); err != nil {
		t.Errorf("other vm lost: %v", err)
	}
	// After Forget, a new boot starts at 1 again.
	a, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: "0000abcd", Image: img})
	if err != nil || a.GetBoot() != 1 {
		t.Errorf("boot after forget = %v %v", a, err)
	}
}

func TestBeginBootKeepsPinnedAK(t *testing.T) {
	s, st, _ := newServer(t, tempDB(t), Options{})
	if err := st.PutVM(&policystore.VM{ID: "0000abcd", Image: img, AKPub: []byte{1, 2, 3}, AKFingerprint: "fp"}, &attestationv1.Attestation{Boot: 4}); err != nil {
		t.Fatal(err)
	}
	a, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: "0000abcd", Image: "flatcar_4231.0.0", KubernetesVersion: "v1.34.0", Required: true})
	if err != nil {
		t.Fatal(err)
	}
	if a.GetBoot() != 5 {
		t.Errorf("boot = %d, want 5", a.GetBoot())
	}
	vm, att, err := st.GetVM("0000abcd")
	if err != nil {
		t.Fatal(err)
	}
	if string(vm.AKPub) != "\x01\x02\x03" || vm.AKFingerprint != "fp" {
		t.Errorf("pinned AK lost: %v %q", vm.AKPub, vm.AKFingerprint)
	}
	if vm.Image != "flatcar_4231.0.0" || vm.KubernetesVersion != "v1.34.0" {
		t.Errorf("vm = %+v", vm)
	}
	if !proto.Equal(att, a) {
		t.Errorf("stored attestation %v != returned %v", att, a)
	}
}

// The VM locks serialize one VM's callers and forget the VM when the last
// one leaves.
func TestVMLocks(t *testing.T) {
	l := newVMLocks()
	unlock := l.lock("0a0b0c0d")
	l.lock("0e0e0e0e")() // another VM does not wait
	got := make(chan struct{})
	go func() {
		defer l.lock("0a0b0c0d")()
		close(got)
	}()
	// refs counts the waiter before it blocks.
	waitFor(func() bool { return l.locks["0a0b0c0d"].refs == 2 }, &l.mu)
	select {
	case <-got:
		t.Fatal("a second caller of the same VM got the lock")
	default:
	}
	unlock()
	<-got
	waitFor(func() bool { return len(l.locks) == 0 }, &l.mu)
}

// waitFor yields until cond, read under mu, holds.
func waitFor(cond func() bool, mu *sync.Mutex) {
	for {
		mu.Lock()
		ok := cond()
		mu.Unlock()
		if ok {
			return
		}
		runtime.Gosched()
	}
}
