package apiserver

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/vtpm"
	"github.com/giantswarm/vm-manager/pkg/vtpm/vtpmtest"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	"google.golang.org/protobuf/types/known/structpb"
)

const vmA = "0a0b0c0d"

// zeroPolicy pins every golden PCR (and PCR 9) and both PCR 11 phases to
// zero: what a fresh TPM's PCRs are, so quotes over zeros match it.
func zeroPolicy(t testing.TB, s *Server, golden ...uint32) {
	t.Helper()
	z := strings.Repeat("0", 64)
	g := map[string]any{}
	for _, i := range golden {
		g[strconv.Itoa(int(i))] = z
	}
	doc, err := structpb.NewStruct(map[string]any{
		"pcr11":  map[string]any{"enter-initrd": z, "enter-initrd:leave-initrd:sysinit:ready": z},
		"golden": map[string]any{"sha256": g},
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: doc}); err != nil {
		t.Fatal(err)
	}
}

func softAK(t testing.TB) *vtpmtest.SoftwareAK {
	t.Helper()
	k, err := vtpmtest.NewSoftwareAK()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// zeros are the PCRs a quote at stage covers, all zero.
func zeros(stage attestationv1.Stage, extra ...uint32) map[uint32][]byte {
	out := map[uint32][]byte{}
	idx := []uint32{0, 1, 2, 3, 4, 5, 6, 7, 11}
	if stage == attestationv1.Stage_STAGE_READY {
		idx = append(idx, 13)
	}
	for _, i := range append(idx, extra...) {
		out[i] = make([]byte, 32)
	}
	return out
}

func nonceFor(t *testing.T, s *Server, vm string) []byte {
	t.Helper()
	n, err := s.IssueNonce(ctx, &attestationv1.IssueNonceRequest{VmId: vm})
	if err != nil {
		t.Fatal(err)
	}
	return n.GetNonce()
}

func quoteWith(t *testing.T, s *Server, k *vtpmtest.SoftwareAK, vm string, stage attestationv1.Stage, nonce []byte, pcrs map[uint32][]byte) *attestationv1.VerifyQuoteResponse {
	t.Helper()
	att, sig, err := k.Quote(nonce, pcrs)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := s.VerifyQuote(ctx, &attestationv1.VerifyQuoteRequest{VmId: vm, Stage: stage, Nonce: nonce, AkPub: k.Public, Quote: att, Signature: sig, Pcrs: pcrs})
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func expectVerdict(t *testing.T, resp *attestationv1.VerifyQuoteResponse, verified bool, msg string) {
	t.Helper()
	if resp.GetVerified() != verified || !strings.Contains(resp.GetMessage(), msg) {
		t.Fatalf("verdict %v %q, want %v %q", resp.GetVerified(), resp.GetMessage(), verified, msg)
	}
	t.Logf("verdict: %v: %s", resp.GetVerified(), resp.GetMessage())
}

// A key nobody registered counts for nothing, however its public area
// describes itself and whatever PCRs it signs: there is no trust on first
// use. (With the first-use pin this quote verified and released user-data.)
func TestUnregisteredKeyIsRejected(t *testing.T) {
	s, _, _ := newServer(t, tempDB(t), Options{Mode: attestationv1.Mode_MODE_VERIFY})
	zeroPolicy(t, s, 0, 2, 3, 4, 6, 7)
	if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: vmA, Image: img, Required: true}); err != nil {
		t.Fatal(err)
	}
	forged := softAK(t)
	resp := quoteWith(t, s, forged, vmA, attestationv1.Stage_STAGE_INITRD, nonceFor(t, s, vmA), zeros(attestationv1.Stage_STAGE_INITRD))
	expectVerdict(t, resp, false, "is not the vTPM key of vm "+vmA+": no key is registered")
	if resp.GetUserDataReleased() || resp.GetAttestation().GetAkFingerprint() != "" {
		t.Errorf("the forged key gained something: %v", resp.GetAttestation())
	}
}

// The host registers the vTPM's key at BeginBoot; its very first quote
// verifies, and any other key is refused by name.
func TestRegisteredKeyVerifiesOnFirstQuote(t *testing.T) {
	s, st, _ := newServer(t, tempDB(t), Options{Mode: attestationv1.Mode_MODE_VERIFY})
	zeroPolicy(t, s, 0, 2, 3, 4, 6, 7)
	real, forged := softAK(t), softAK(t)
	att, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: vmA, Image: img, Required: true, AkPublic: real.Public})
	if err != nil {
		t.Fatal(err)
	}
	if att.GetAkFingerprint() != vtpm.Fingerprint(real.Public) || att.GetAkOrigin() != attestationv1.AkOrigin_AK_ORIGIN_HOST || att.GetUserDataReleased() {
		t.Fatalf("BeginBoot: %v", att)
	}
	resp := quoteWith(t, s, forged, vmA, attestationv1.Stage_STAGE_INITRD, nonceFor(t, s, vmA), zeros(attestationv1.Stage_STAGE_INITRD))
	expectVerdict(t, resp, false, "ak "+vtpm.Fingerprint(forged.Public)[:16]+" is not the vTPM key of vm "+vmA+" (the host registered "+vtpm.Fingerprint(real.Public)[:16]+")")
	resp = quoteWith(t, s, real, vmA, attestationv1.Stage_STAGE_INITRD, nonceFor(t, s, vmA), zeros(attestationv1.Stage_STAGE_INITRD))
	expectVerdict(t, resp, true, "verified: ak ")
	if !resp.GetUserDataReleased() {
		t.Error("a verified initrd quote did not release user-data")
	}
	vm, _, _ := st.GetVM(vmA)
	if vm.AKOrigin != policystore.OriginHost {
		t.Errorf("origin %q", vm.AKOrigin)
	}
	// A key that is no AK is refused at registration.
	bad := append([]byte(nil), real.Public...)
	bad[len(bad)-1] ^= 0xff // off the curve
	if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: vmA, Image: img, AkPublic: bad}); err == nil {
		t.Error("BeginBoot took a key off the curve")
	}
}

// A pin from before host provisioning stays, says so, and gives way to the
// key the host registers at the VM's next boot.
func TestFirstUsePinUntilTheHostRegisters(t *testing.T) {
	s, st, _ := newServer(t, tempDB(t), Options{Mode: attestationv1.Mode_MODE_VERIFY})
	zeroPolicy(t, s, 0, 2, 3, 4, 6, 7)
	pinned, host := softAK(t), softAK(t)
	if err := st.PutVM(&policystore.VM{ID: vmA, Image: img, AKPub: pinned.Public, AKFingerprint: vtpm.Fingerprint(pinned.Public), AKOrigin: policystore.OriginFirstUse},
		&attestationv1.Attestation{Boot: 3, Required: true}); err != nil {
		t.Fatal(err)
	}
	got, err := s.GetVirtualMachineAttestation(ctx, &attestationv1.GetVirtualMachineAttestationRequest{Id: vmA})
	if err != nil || got.GetAkOrigin() != attestationv1.AkOrigin_AK_ORIGIN_FIRST_USE {
		t.Fatalf("attestation of a first-use vm: %v %v", got, err)
	}
	resp := quoteWith(t, s, host, vmA, attestationv1.Stage_STAGE_INITRD, nonceFor(t, s, vmA), zeros(attestationv1.Stage_STAGE_INITRD))
	expectVerdict(t, resp, false, "(pinned on first use: "+vtpm.Fingerprint(pinned.Public)[:16]+")")
	// The next boot registers the vTPM's key.
	if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: vmA, Image: img, Required: true, AkPublic: host.Public}); err != nil {
		t.Fatal(err)
	}
	resp = quoteWith(t, s, pinned, vmA, attestationv1.Stage_STAGE_INITRD, nonceFor(t, s, vmA), zeros(attestationv1.Stage_STAGE_INITRD))
	expectVerdict(t, resp, false, "the host registered")
	resp = quoteWith(t, s, host, vmA, attestationv1.Stage_STAGE_INITRD, nonceFor(t, s, vmA), zeros(attestationv1.Stage_STAGE_INITRD))
	expectVerdict(t, resp, true, "verified")
	if resp.GetAttestation().GetAkOrigin() != attestationv1.AkOrigin_AK_ORIGIN_HOST {
		t.Errorf("origin after registration: %v", resp.GetAttestation().GetAkOrigin())
	}
}

// A nonce of boot N is worthless in boot N+1, even unused and unexpired.
func TestNonceOfAnEarlierBoot(t *testing.T) {
	s, _, _ := newServer(t, tempDB(t), Options{Mode: attestationv1.Mode_MODE_VERIFY})
	zeroPolicy(t, s, 0, 2, 3, 4, 6, 7)
	k := softAK(t)
	begin := func() {
		if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: vmA, Image: img, Required: true, AkPublic: k.Public}); err != nil {
			t.Fatal(err)
		}
	}
	begin()
	old := nonceFor(t, s, vmA)
	begin()
	resp := quoteWith(t, s, k, vmA, attestationv1.Stage_STAGE_INITRD, old, zeros(attestationv1.Stage_STAGE_INITRD))
	expectVerdict(t, resp, false, "unknown or expired nonce")
	if resp.GetUserDataReleased() {
		t.Error("released on a previous boot's nonce")
	}
}

// A direct-kernel VM's PCR 9 is golden: without a value it is missing, and a
// quote that leaves it out does not dodge it.
func TestDirectKernelNeedsPCR9(t *testing.T) {
	s, _, _ := newServer(t, tempDB(t), Options{Mode: attestationv1.Mode_MODE_VERIFY})
	zeroPolicy(t, s, 0, 2, 3, 4, 6, 7)
	k := softAK(t)
	if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: vmA, Image: img, Required: true, AkPublic: k.Public, DirectKernel: true}); err != nil {
		t.Fatal(err)
	}
	resp := quoteWith(t, s, k, vmA, attestationv1.Stage_STAGE_INITRD, nonceFor(t, s, vmA), zeros(attestationv1.Stage_STAGE_INITRD, 9))
	expectVerdict(t, resp, false, "no golden value for pcr 9")
	zeroPolicy(t, s, 0, 2, 3, 4, 6, 7, 9)
	resp = quoteWith(t, s, k, vmA, attestationv1.Stage_STAGE_INITRD, nonceFor(t, s, vmA), zeros(attestationv1.Stage_STAGE_INITRD))
	expectVerdict(t, resp, false, "pcr 9 has a golden value but was not quoted")
	resp = quoteWith(t, s, k, vmA, attestationv1.Stage_STAGE_INITRD, nonceFor(t, s, vmA), zeros(attestationv1.Stage_STAGE_INITRD, 9))
	expectVerdict(t, resp, true, "verified")
}

// Learn mode judges an image without a policy as an empty one, labels what
// it produced, and RecordGolden then creates the policy.
func TestLearnModeLabelsItsVerdicts(t *testing.T) {
	path := tempDB(t)
	s, st, _ := newServer(t, path, Options{Mode: attestationv1.Mode_MODE_VERIFY, LearnGolden: true})
	k := softAK(t)
	if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: vmA, Image: img, Required: true, AkPublic: k.Public, DirectKernel: true}); err != nil {
		t.Fatal(err)
	}
	for _, stage := range []attestationv1.Stage{attestationv1.Stage_STAGE_INITRD, attestationv1.Stage_STAGE_READY} {
		resp := quoteWith(t, s, k, vmA, stage, nonceFor(t, s, vmA), zeros(stage, 9))
		expectVerdict(t, resp, true, "verified in learn mode: ak ")
		q := resp.GetAttestation().GetInitrd()
		if stage == attestationv1.Stage_STAGE_READY {
			q = resp.GetAttestation().GetReady()
		}
		if !q.GetLearnMode() || len(q.GetLearned()) == 0 {
			t.Errorf("%s verdict not labelled: %v", stage, q)
		}
	}
	p, err := s.RecordGolden(ctx, &attestationv1.RecordGoldenRequest{Image: img, FromVm: vmA})
	if err != nil {
		t.Fatalf("RecordGolden without a policy: %v", err)
	}
	if got := p.GetGoldenPcrs(); fmt.Sprint(got) != "[2 3 4 6 7 9 13]" {
		t.Errorf("golden pcrs %v, want 2,3,4,6,7,9,13 (0 depends on the vm's memory and cpus)", got)
	}
	if f := p.GetDocument().GetFields(); f["image_id"].GetStringValue() != "flatcar" || f["image_version"].GetStringValue() != "4230.2.0" {
		t.Errorf("created policy %v", f)
	}
	// Learn mode off: the verdicts it produced keep their label.
	s2 := mustNew(t, st, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	a, err := s2.GetVirtualMachineAttestation(ctx, &attestationv1.GetVirtualMachineAttestationRequest{Id: vmA})
	if err != nil || !a.GetInitrd().GetLearnMode() || !a.GetReady().GetLearnMode() {
		t.Errorf("after learn mode: %v %v", a, err)
	}
	resp := quoteWith(t, s2, k, vmA, attestationv1.Stage_STAGE_READY, nonceFor(t, s2, vmA), zeros(attestationv1.Stage_STAGE_READY, 9))
	expectVerdict(t, resp, true, "verified: ak ")
	if resp.GetAttestation().GetReady().GetLearnMode() {
		t.Error("a verdict outside learn mode is labelled learn mode")
	}
}

// A policy that enforces nothing is refused, on import and on sync.
func TestPolicyThatEnforcesNothing(t *testing.T) {
	s, _, _ := newServer(t, tempDB(t), Options{})
	for _, doc := range []map[string]any{
		{},
		{"image_id": "flatcar", "image_version": "4230.2.0"},
		{"golden": map[string]any{"sha256": map[string]any{}}},
		{"pcr13": map[string]any{"v1.33.1": hex32('c')}},
	} {
		d, _ := structpb.NewStruct(doc)
		_, err := s.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: img, Document: d})
		wantCode(t, err, "invalid_request")
		_, err = s.SyncImagePolicy(ctx, &attestationv1.SyncImagePolicyRequest{Image: img, Document: d})
		wantCode(t, err, "invalid_request")
		if !strings.Contains(err.Error(), "enforces nothing") {
			t.Errorf("%v: %v", doc, err)
		}
	}
	if _, err := s.GetImagePolicy(ctx, &attestationv1.GetImagePolicyRequest{Image: img}); err == nil {
		t.Error("a refused import stored a policy")
	}
}

// A guest that skips the initrd stage (or whose initrd quote was rejected)
// and sends a good ready-stage quote gets no user-data: only a verified
// initrd quote opens the gate (pkg/gate), since user-data is what the
// initrd fetches.
func TestReadyQuoteDoesNotReleaseUserData(t *testing.T) {
	s, _, _ := newServer(t, tempDB(t), Options{Mode: attestationv1.Mode_MODE_VERIFY})
	zeroPolicy(t, s, 0, 2, 3, 4, 6, 7)
	k := softAK(t)
	if _, err := s.BeginBoot(ctx, &attestationv1.BeginBootRequest{VmId: vmA, Image: img, Required: true, AkPublic: k.Public}); err != nil {
		t.Fatal(err)
	}
	bad := zeros(attestationv1.Stage_STAGE_INITRD)
	bad[4] = []byte("0123456789abcdef0123456789abcdef") // not the golden PCR 4
	expectVerdict(t, quoteWith(t, s, k, vmA, attestationv1.Stage_STAGE_INITRD, nonceFor(t, s, vmA), bad), false, "")
	resp := quoteWith(t, s, k, vmA, attestationv1.Stage_STAGE_READY, nonceFor(t, s, vmA), zeros(attestationv1.Stage_STAGE_READY))
	expectVerdict(t, resp, true, "verified")
	if resp.GetUserDataReleased() || resp.GetAttestation().GetUserDataReleased() {
		t.Fatalf("a ready-stage quote released user-data: %v", resp)
	}
	att, err := s.GetVirtualMachineAttestation(ctx, &attestationv1.GetVirtualMachineAttestationRequest{Id: vmA})
	if err != nil || att.GetUserDataReleased() {
		t.Fatalf("stored: %v %v", att, err)
	}
}
