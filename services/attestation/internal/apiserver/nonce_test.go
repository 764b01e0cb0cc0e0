package apiserver

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"os"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/nonce"
)

// Issuing nonces writes nothing to attestation.db, however many a guest asks
// for: the file is byte for byte the same. The VM keeps 8, the rest are
// dropped and counted, and nonceIssuedAt still tells when the last was issued.
func TestIssueNonceWritesNothing(t *testing.T) {
	path := tempDB(t)
	s, _, c := newServer(t, path, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: vmA, Image: img, Required: true}); err != nil {
		t.Fatal(err)
	}
	before := fileSum(t, path)
	for range 100 {
		nonceFor(t, s, vmA)
	}
	issuedAt := c.t
	if fileSum(t, path) != before {
		t.Error("issuing nonces wrote to attestation.db")
	}
	st, err := s.GetAttestationStatus(ctx, &attestationv1.GetAttestationStatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if n := st.GetNonces(); n.GetIssued() != 100 || n.GetOutstanding() != nonce.PerVM || n.GetDroppedPerVm() != 100-nonce.PerVM || n.GetLimit() != nonce.DefaultMax {
		t.Errorf("nonce stats %v", n)
	}
	att, err := s.GetVirtualMachineAttestation(ctx, &attestationv1.GetVirtualMachineAttestationRequest{Id: vmA})
	if err != nil || !att.GetNonceIssuedAt().AsTime().Equal(issuedAt) {
		t.Errorf("nonceIssuedAt %v, want %v (%v)", att.GetNonceIssuedAt().AsTime(), issuedAt, err)
	}
	// Forgetting the VM drops its nonces.
	if _, err := s.ForgetVirtualMachine(ctx, &attestationv1.ForgetVirtualMachineRequest{VmId: vmA}); err != nil {
		t.Fatal(err)
	}
	if st, _ := s.GetAttestationStatus(ctx, &attestationv1.GetAttestationStatusRequest{}); st.GetNonces().GetOutstanding() != 0 {
		t.Errorf("after forget: %v", st.GetNonces())
	}
}

func fileSum(t *testing.T, path string) [32]byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return sha256.Sum256(b)
}

// A restart loses the outstanding nonces. A quote on one is answered
// unavailable (vm-agent retries with a new nonce; a verdict would be final)
// and changes nothing; another VM's nonce, or this VM's of another boot, is
// still a rejection; a fresh nonce verifies; the verdicts from before stay.
func TestNonceLostInRestart(t *testing.T) {
	path := tempDB(t)
	s, st, c := newServer(t, path, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	zeroPolicy(t, s, 0, 2, 3, 4, 6, 7)
	k := softAK(t)
	for _, id := range []string{vmA, "0e0e0e0e"} {
		if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: id, Image: img, Required: true, AkPublic: k.Public}); err != nil {
			t.Fatal(err)
		}
	}
	initrd := attestationv1.Stage_STAGE_INITRD
	ready := attestationv1.Stage_STAGE_READY
	expectVerdict(t, quoteWith(t, s, k, vmA, initrd, nonceFor(t, s, vmA), zeros(initrd)), true, "verified")
	lost := nonceFor(t, s, vmA)
	otherVM := nonceFor(t, s, "0e0e0e0e")

	// The restart: a new server over the same database.
	s = mustNew(t, st, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	s.now = c.now
	if err := s.resetNonces(); err != nil {
		t.Fatal(err)
	}
	before := fileSum(t, path)
	for range 2 { // and a replay of it: the same answer
		q, sig, err := k.Quote(lost, zeros(ready))
		if err != nil {
			t.Fatal(err)
		}
		resp, err := s.VerifyQuote(ctx, &attestationv1.VerifyQuoteRequest{VmId: vmA, Stage: ready, Nonce: lost, AkPub: k.Public, Quote: q, Signature: sig, Pcrs: zeros(ready)})
		if !errors.Is(err, ErrNonceLost) || apierr.CodeOf(err) != apierr.Unavailable {
			t.Fatalf("quote on a lost nonce: %v %v, want %v", resp, err, ErrNonceLost)
		}
	}
	if fileSum(t, path) != before {
		t.Error("a quote on a lost nonce wrote to attestation.db")
	}
	if st, _ := s.GetAttestationStatus(ctx, &attestationv1.GetAttestationStatusRequest{}); st.GetNonces().GetLostInRestart() != 2 {
		t.Errorf("nonce stats %v", st.GetNonces())
	}
	// Another VM's nonce from before the restart is no lost nonce of this one.
	expectVerdict(t, quoteWith(t, s, k, vmA, ready, otherVM, zeros(ready)), false, "unknown or expired nonce")
	// Nor is this VM's after a new boot.
	stale := nonceFor(t, s, vmA)
	s = mustNew(t, st, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	s.now = c.now
	if err := s.resetNonces(); err != nil {
		t.Fatal(err)
	}
	att, err := s.GetVirtualMachineAttestation(ctx, &attestationv1.GetVirtualMachineAttestationRequest{Id: vmA})
	if err != nil || !att.GetInitrd().GetVerified() || !att.GetUserDataReleased() {
		t.Fatalf("the verified verdict from before the restarts: %v %v", att, err)
	}
	if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: vmA, Image: img, Required: true, AkPublic: k.Public}); err != nil {
		t.Fatal(err)
	}
	resp := quoteWith(t, s, k, vmA, initrd, stale, zeros(initrd))
	expectVerdict(t, resp, false, "unknown or expired nonce")
	// A fresh nonce verifies.
	resp = quoteWith(t, s, k, vmA, initrd, nonceFor(t, s, vmA), zeros(initrd))
	expectVerdict(t, resp, true, "verified")
	if !resp.GetUserDataReleased() || bytes.Equal(lost, stale) {
		t.Errorf("after the fresh nonce: %v", resp)
	}
}
