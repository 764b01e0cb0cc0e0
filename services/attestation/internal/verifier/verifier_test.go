package verifier

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/gate"
	"github.com/giantswarm/vm-manager/pkg/vtpm"
	"github.com/giantswarm/vm-manager/pkg/vtpm/vtpmtest"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

const (
	vmA = "0a0b0c0d"
	img = "flatcar_4230.2.0"
)

var (
	initrd = attestationv1.Stage_STAGE_INITRD
	ready  = attestationv1.Stage_STAGE_READY
	zero   = strings.Repeat("0", 64)
)

// rig is a Verifier over fakes: vmA in its first boot with attestation
// required and the rig's key registered by the host, and a policy that pins
// PCR 11 and the golden PCRs to zero (a fresh TPM's values).
type rig struct {
	t      *testing.T
	v      *Verifier
	vms    *fakeVMs
	pols   *fakePolicies
	nonces *fakeNonces
	locks  *fakeLocks
	ak     *vtpmtest.SoftwareAK
	now    time.Time
	seq    byte
}

func newRig(t *testing.T, opts Options) *rig {
	t.Helper()
	locks := &fakeLocks{held: map[string]bool{}}
	r := &rig{
		t:      t,
		vms:    &fakeVMs{t: t, locks: locks, recs: map[string]record{}},
		pols:   &fakePolicies{policies: map[string]*attestationv1.ImagePolicy{}, golden: map[string][]verify.Event{}},
		nonces: &fakeNonces{live: map[string]bool{}, lost: map[string]bool{}, issuedAt: map[string]time.Time{}},
		locks:  locks,
		ak:     softAK(t),
		now:    time.Date(2025, 6, 1, 12, 0, 0, 0, time.UTC),
	}
	att := gate.NewBoot(true)
	att.Boot = 1
	r.vms.put(policystore.VM{ID: vmA, Image: img, AKPub: r.ak.Public, AKFingerprint: vtpm.Fingerprint(r.ak.Public), AKOrigin: policystore.OriginHost}, att)
	r.pols.policies[img] = &attestationv1.ImagePolicy{Image: img, Document: doc(t, map[string]any{
		"pcr11":  map[string]any{"enter-initrd": zero, "enter-initrd:leave-initrd:sysinit:ready": zero},
		"golden": map[string]any{"sha256": map[string]any{"0": zero, "2": zero, "3": zero, "4": zero, "6": zero, "7": zero}},
	})}
	opts.Now = func() time.Time { r.now = r.now.Add(time.Second); return r.now }
	r.v = New(r.vms, r.pols, r.nonces, locks, opts)
	return r
}

func doc(t *testing.T, m map[string]any) *structpb.Struct {
	t.Helper()
	d, err := structpb.NewStruct(m)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func softAK(t *testing.T) *vtpmtest.SoftwareAK {
	t.Helper()
	k, err := vtpmtest.NewSoftwareAK()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// nonce issues a fresh nonce to vmA's current boot.
func (r *rig) nonce() []byte {
	r.seq++
	n := bytes.Repeat([]byte{r.seq}, 32)
	r.nonces.issue(vmA, r.vms.att(vmA).GetBoot(), n)
	return n
}

// zeros are the PCRs a quote at stage covers, all zero.
func zeros(stage attestationv1.Stage) map[uint32][]byte {
	out := map[uint32][]byte{}
	for _, i := range verify.RequiredPCRs(stage) {
		out[i] = make([]byte, 32)
	}
	return out
}

// quote is vmA's submission of a quote by k.
func (r *rig) quote(k *vtpmtest.SoftwareAK, stage attestationv1.Stage, n []byte, pcrs map[uint32][]byte) Submission {
	r.t.Helper()
	att, sig, err := k.Quote(n, pcrs)
	if err != nil {
		r.t.Fatal(err)
	}
	return Submission{VMID: vmA, Nonce: n, Quote: verify.Quote{Stage: stage, AKPub: k.Public, Attest: att, Signature: sig, PCRs: pcrs}}
}

func (r *rig) verify(sub Submission) *Verdict {
	r.t.Helper()
	v, err := r.v.Verify(sub)
	if err != nil {
		r.t.Fatalf("Verify: %v", err)
	}
	if r.announced() != 0 {
		r.t.Errorf("%d announcements left outstanding", r.announced())
	}
	return v
}

func (r *rig) announced() int { return r.vms.announced }

func expect(t *testing.T, v *Verdict, verified bool, msg string) {
	t.Helper()
	if v.Quote.GetVerified() != verified || !strings.Contains(v.Quote.GetMessage(), msg) {
		t.Fatalf("verdict %v %q, want %v %q", v.Quote.GetVerified(), v.Quote.GetMessage(), verified, msg)
	}
}

func TestVerifiedInitrdQuoteReleasesUserData(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	v := r.verify(r.quote(r.ak, initrd, r.nonce(), zeros(initrd)))
	expect(t, v, true, "verified: ak "+vtpm.Fingerprint(r.ak.Public)[:16])
	if !v.UserDataReleased || !v.Attestation.GetUserDataReleased() {
		t.Errorf("not released: %v", v)
	}
	got := r.vms.att(vmA)
	if !got.GetInitrd().GetVerified() || !got.GetUserDataReleased() || got.GetInitrd().GetAkFingerprint() != vtpm.Fingerprint(r.ak.Public) {
		t.Errorf("recorded %v", got)
	}
	if !got.GetInitrd().GetAt().AsTime().Equal(r.now) {
		t.Errorf("stamped %v, want the clock's %v", got.GetInitrd().GetAt().AsTime(), r.now)
	}
	if r.vms.puts != 1 || r.locks.taken != 1 {
		t.Errorf("%d writes under %d locks, want 1 and 1", r.vms.puts, r.locks.taken)
	}
}

// Only a verified initrd quote opens the gate: user-data is what the
// initrd fetches.
func TestReadyQuoteDoesNotReleaseUserData(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	v := r.verify(r.quote(r.ak, ready, r.nonce(), zeros(ready)))
	expect(t, v, true, "verified")
	if v.UserDataReleased || r.vms.att(vmA).GetUserDataReleased() {
		t.Errorf("a ready quote released user-data: %v", v)
	}
}

func TestNonceReplayIsRefused(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	n := r.nonce()
	expect(t, r.verify(r.quote(r.ak, initrd, n, zeros(initrd))), true, "verified")
	v := r.verify(r.quote(r.ak, ready, n, zeros(ready)))
	expect(t, v, false, "unknown or expired nonce")
	if q := r.vms.att(vmA).GetReady(); q.GetVerified() || q.GetMessage() != "unknown or expired nonce" {
		t.Errorf("replay recorded as %v", q)
	}
}

// Any attempt uses its nonce up, a rejected one too: a guest cannot try
// quote after quote on one nonce.
func TestRejectedQuoteUsesUpItsNonce(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	n := r.nonce()
	forged := r.quote(r.ak, initrd, n, zeros(initrd))
	forged.Signature = bytes.Clone(forged.Signature)
	forged.Signature[len(forged.Signature)-1] ^= 1
	expect(t, r.verify(forged), false, "")
	expect(t, r.verify(r.quote(r.ak, initrd, n, zeros(initrd))), false, "unknown or expired nonce")
}

func TestWrongPCRIsRefusedAndRecorded(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	bad := zeros(initrd)
	bad[4] = bytes.Repeat([]byte{0x42}, 32)
	v := r.verify(r.quote(r.ak, initrd, r.nonce(), bad))
	expect(t, v, false, "golden mismatch: pcr 4 expected "+zero+", got "+strings.Repeat("42", 32))
	if v.UserDataReleased {
		t.Error("a rejected quote released user-data")
	}
	q := r.vms.att(vmA).GetInitrd()
	if q.GetVerified() || q.GetMessage() != v.Quote.GetMessage() || q.GetPcrs()[4] != strings.Repeat("42", 32) || r.vms.att(vmA).GetUserDataReleased() {
		t.Errorf("recorded %v", r.vms.att(vmA))
	}
}

// A nonce lost in a restart is an error the guest retries on, not a
// verdict: nothing is written.
func TestLostNonceRecordsNothing(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	n := bytes.Repeat([]byte{0xee}, 32)
	r.nonces.lost[nonceKey(vmA, 1, n)] = true
	_, err := r.v.Verify(r.quote(r.ak, initrd, n, zeros(initrd)))
	if !errors.Is(err, ErrNonceLost) || apierr.CodeOf(err) != apierr.Unavailable {
		t.Fatalf("Verify: %v, want %v", err, ErrNonceLost)
	}
	if r.vms.puts != 0 || r.announced() != 0 {
		t.Errorf("%d writes, %d announcements outstanding", r.vms.puts, r.announced())
	}
}

// Only the key registered for the VM counts, whatever the quote's key
// claims to be.
func TestQuoteByAnotherKeyIsRefused(t *testing.T) {
	for _, c := range []struct {
		name   string
		vm     func(vm *policystore.VM)
		reason string
	}{
		{"no key registered", func(vm *policystore.VM) { vm.AKPub, vm.AKFingerprint, vm.AKOrigin = nil, "", "" },
			"is not the vTPM key of vm " + vmA + ": no key is registered for it"},
		{"the host registered another", func(*policystore.VM) {}, "(the host registered "},
		{"another pinned on first use", func(vm *policystore.VM) { vm.AKOrigin = policystore.OriginFirstUse }, "(pinned on first use: "},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
			forged := softAK(t)
			rec := r.vms.recs[vmA]
			c.vm(&rec.vm)
			r.vms.recs[vmA] = rec
			v := r.verify(r.quote(forged, initrd, r.nonce(), zeros(initrd)))
			expect(t, v, false, "ak "+vtpm.Fingerprint(forged.Public)[:16]+" is not the vTPM key")
			expect(t, v, false, c.reason)
			if v.UserDataReleased {
				t.Error("the forged key released user-data")
			}
		})
	}
}

func TestFirmwareMismatch(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	r.pols.policies[img].Document.Fields["golden_firmware"] = structpb.NewStructValue(doc(t, map[string]any{"sha256": strings.Repeat("f", 64), "package": "ovmf", "version": "1"}))
	rec := r.vms.recs[vmA]
	rec.vm.Firmware = &policystore.Firmware{SHA256: strings.Repeat("e", 64), Package: "ovmf", Version: "2"}
	r.vms.recs[vmA] = rec
	v := r.verify(r.quote(r.ak, initrd, r.nonce(), zeros(initrd)))
	expect(t, v, false, "firmware mismatch: the golden values were recorded on firmware ovmf 1 (sha256 ffffffffffffffff), this vm boots ovmf 2 (sha256 eeeeeeeeeeeeeeee)")
	// The same build, however its digest is spelled, verifies.
	rec.vm.Firmware.SHA256 = strings.Repeat("F", 64)
	r.vms.recs[vmA] = rec
	expect(t, r.verify(r.quote(r.ak, initrd, r.nonce(), zeros(initrd))), true, "verified")
}

// Anything in the guest can post a bad quote: it does not undo the boot's
// verified verdict of the same stage, though it is answered as rejected.
func TestRejectionKeepsVerifiedVerdict(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	good := r.verify(r.quote(r.ak, initrd, r.nonce(), zeros(initrd)))
	bad := zeros(initrd)
	bad[7] = bytes.Repeat([]byte{1}, 32)
	v := r.verify(r.quote(r.ak, initrd, r.nonce(), bad))
	expect(t, v, false, "golden mismatch: pcr 7")
	got := r.vms.att(vmA)
	if !got.GetInitrd().GetVerified() || got.GetInitrd().GetMessage() != good.Quote.GetMessage() || !got.GetUserDataReleased() || !v.UserDataReleased {
		t.Errorf("after a rejection: %v (answered released %v)", got, v.UserDataReleased)
	}
	if r.vms.puts != 2 {
		t.Errorf("%d writes: the rejection is recorded (nonceIssuedAt) all the same", r.vms.puts)
	}
}

// Without a policy a quote is refused, except in learn mode, which judges it
// against an empty one and says what it learned.
func TestImageWithoutPolicy(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	delete(r.pols.policies, img)
	expect(t, r.verify(r.quote(r.ak, initrd, r.nonce(), zeros(initrd))), false, "no policy for image "+img+": import its policy.json")

	r = newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY, LearnGolden: true})
	delete(r.pols.policies, img)
	v := r.verify(r.quote(r.ak, initrd, r.nonce(), zeros(initrd)))
	expect(t, v, true, "verified in learn mode: ak ")
	expect(t, v, true, "; accepted without golden value: 2=")
	if !v.Quote.GetLearnMode() || len(v.Quote.GetLearned()) != 5 {
		t.Errorf("learn-mode verdict %v", v.Quote)
	}
}

// noop accepts any quote on a valid nonce, and nothing without one.
func TestNoopChecksOnlyTheNonce(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_NOOP})
	garbage := Submission{VMID: vmA, Nonce: r.nonce(), Quote: verify.Quote{Stage: initrd, Attest: []byte("not a quote")}}
	v := r.verify(garbage)
	expect(t, v, true, "accepted without verification (--attestation=noop)")
	if !v.UserDataReleased {
		t.Error("noop did not release user-data")
	}
	expect(t, r.verify(garbage), false, "unknown or expired nonce")
}

// A stage other than initrd or ready is the caller's mistake: nothing is
// locked, no nonce used up.
func TestStageIsChecked(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	sub := r.quote(r.ak, initrd, r.nonce(), zeros(initrd))
	sub.Stage = attestationv1.Stage_STAGE_UNSPECIFIED
	_, err := r.v.Verify(sub)
	var e *apierr.Error
	if !errors.As(err, &e) || e.Code != apierr.InvalidRequest || e.Metadata["field"] != "stage" {
		t.Fatalf("Verify: %v, want invalid stage", err)
	}
	if r.nonces.consumed != 0 || r.locks.taken != 0 {
		t.Errorf("%d nonces used, %d locks taken", r.nonces.consumed, r.locks.taken)
	}
	sub.VMID = "0e0e0e0e"
	sub.Stage = initrd
	if _, err := r.v.Verify(sub); apierr.CodeOf(err) != apierr.NotFound || r.nonces.consumed != 0 {
		t.Errorf("unknown vm: %v, %d nonces used", err, r.nonces.consumed)
	}
}

// Nonces are not stored: a read of the record says when this run last
// issued one, unless the record knows of a later one.
func TestAttestationNotesNonceIssuedAt(t *testing.T) {
	r := newRig(t, Options{})
	at := time.Date(2025, 6, 1, 13, 0, 0, 0, time.UTC)
	r.nonces.issuedAt[vmA] = at
	got, err := r.v.Attestation(vmA)
	if err != nil || !got.GetNonceIssuedAt().AsTime().Equal(at) {
		t.Fatalf("Attestation: %v %v", got, err)
	}
	r.vms.att(vmA).NonceIssuedAt = timestamppb.New(at.Add(time.Minute))
	if got, _ := r.v.Attestation(vmA); !got.GetNonceIssuedAt().AsTime().Equal(at.Add(time.Minute)) {
		t.Errorf("a later recorded time replaced by an earlier one: %v", got.GetNonceIssuedAt().AsTime())
	}
}

// A golden mismatch names the stored golden boot's events of the PCRs that
// differ, and only those, in PCR order, on the recorded verdict too.
func TestMismatchNamesGoldenEvents(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	r.pols.golden[img] = []verify.Event{
		{PCR: 7, Type: "EV_EFI_VARIABLE_AUTHORITY", Description: "db", Digest: []byte{7}},
		{PCR: 0, Type: "EV_POST_CODE", Description: "firmware", Digest: []byte{0}},
		{PCR: 4, Type: "EV_EFI_BOOT_SERVICES_APPLICATION", Description: "shim", Digest: []byte{4}},
	}
	bad := zeros(initrd)
	bad[7] = bytes.Repeat([]byte{7}, 32)
	bad[4] = bytes.Repeat([]byte{4}, 32)
	v := r.verify(r.quote(r.ak, initrd, r.nonce(), bad))
	expect(t, v, false, "golden mismatch: pcr 4")
	var got []string
	for _, m := range r.vms.att(vmA).GetInitrd().GetMismatchedEvents() {
		got = append(got, fmt.Sprintf("%d %s %s", m.GetPcr(), m.GetDescription(), m.GetExpectedDigest()))
	}
	if want := []string{"4 shim 04", "7 db 07"}; !slices.Equal(got, want) {
		t.Errorf("mismatched events %q, want %q", got, want)
	}
}
