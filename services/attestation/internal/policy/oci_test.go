package policy

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
)

var (
	ociRoot     = hex.EncodeToString(measure.Digest([]byte("python:3.12 erofs root")))
	otherRoot   = hex.EncodeToString(measure.Digest([]byte("another erofs root")))
	ociManifest = "sha256:" + hex.EncodeToString(measure.Digest([]byte("manifest")))
	ociConfig   = "sha256:" + hex.EncodeToString(measure.Digest([]byte("config")))
)

const ociRef = "localhost:5000/python:3.12"

// ociPolicy is an imported OCI image's policy: golden values with PCR 9
// (a direct-kernel boot) and the oci object.
func ociPolicy(root string) map[string]any {
	g := goldenAll()
	g["9"] = hx(0x09)
	return map[string]any{
		"image_id": "python", "image_version": "3.12",
		"golden": map[string]any{"sha256": g},
		"oci":    map[string]any{"reference": ociRef, "manifest_digest": ociManifest, "config_digest": ociConfig, "root_hash": root},
	}
}

// ociQuote is a direct-kernel quote at stage whose PCR 15 is pcr15 (not
// quoted when nil).
func ociQuote(stage attestationv1.Stage, pcr15 []byte) map[uint32][]byte {
	p := quoted(stage)
	p[9] = digest(0x09)
	if pcr15 != nil {
		p[15] = pcr15
	}
	return p
}

// verityEvents are the replayed events of vm-agent's log records of the
// verity roots it measured, as verify reads them (measure.ParseLog).
func verityEvents(t *testing.T, roots ...string) []verify.Event {
	t.Helper()
	var b bytes.Buffer
	for _, r := range roots {
		if err := measure.WriteRecord(&b, measure.WordRecord(measure.PCRVerityRoot, measure.VerityRootWord(r), measure.EventTypeVerityRoot, "", 0)); err != nil {
			t.Fatal(err)
		}
	}
	parsed, err := measure.ParseLog(b.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	var out []verify.Event
	for _, e := range parsed {
		out = append(out, verify.Event{PCR: e.PCR, Type: verify.TypeUserspace, Description: e.Description, Digest: e.Digest})
	}
	return out
}

func TestOCIRootVerified(t *testing.T) {
	for _, stage := range []attestationv1.Stage{attestationv1.Stage_STAGE_INITRD, attestationv1.Stage_STAGE_READY} {
		for _, events := range [][]verify.Event{nil, verityEvents(t, ociRoot)} {
			out := Evaluate(doc(t, ociPolicy(ociRoot)), stage, "", true, "", ociQuote(stage, measure.PCR15(ociRoot)), events, false)
			if out.Reason != "" {
				t.Fatalf("%v: rejected: %s", stage, out.Reason)
			}
			if want := fmt.Sprintf("oci %s@%s root %s", ociRef, ociManifest, ociRoot); !strings.Contains(out.Summary, want) {
				t.Errorf("summary %q, want it to name %q", out.Summary, want)
			}
			o := out.OCI
			if o.GetReference() != ociRef || o.GetManifestDigest() != ociManifest || o.GetConfigDigest() != ociConfig || o.GetRootHash() != ociRoot {
				t.Errorf("verdict's oci image %v", o)
			}
		}
	}
	// The policy's root hash in upper case is the same root.
	out := Evaluate(doc(t, ociPolicy(strings.ToUpper(ociRoot))), attestationv1.Stage_STAGE_INITRD, "", true, "", ociQuote(attestationv1.Stage_STAGE_INITRD, measure.PCR15(ociRoot)), nil, false)
	if out.Reason != "" || out.OCI.GetRootHash() != ociRoot {
		t.Errorf("upper-case root hash: %q, %v", out.Reason, out.OCI)
	}
}

func TestOCIRootRejected(t *testing.T) {
	initrd, ready := attestationv1.Stage_STAGE_INITRD, attestationv1.Stage_STAGE_READY
	want := measure.PCR15(ociRoot)
	img := ociRef + "@" + ociManifest
	mismatch := func(got []byte) string {
		return fmt.Sprintf("verity root mismatch: pcr 15 expected %x, got %x; ", want, got)
	}
	other, twice := measure.PCR15(otherRoot), measure.Replay(slices.Concat(measure.PCR15Events(ociRoot), measure.PCR15Events(ociRoot)))
	foreign := measure.Replay([]measure.Event{measure.WordEvent(15, "machine-id:0123")})
	// A record that claims the policy's root over the digest of another.
	lying := verityEvents(t, otherRoot)
	lying[0].Description = fmt.Sprintf("verity-root %q (not what the digest measured)", measure.VerityRootWord(ociRoot))
	// Its claim alone, as a log without the marker would have it: the
	// digest still decides.
	claim := verityEvents(t, otherRoot)
	claim[0].Description = fmt.Sprintf("verity-root %q", measure.VerityRootWord(ociRoot))
	cases := []struct {
		name   string
		stage  attestationv1.Stage
		pcr15  []byte
		events []verify.Event
		learn  bool
		reason string
		nMis   int
	}{
		{name: "another root, named from the log", stage: initrd, pcr15: other, events: verityEvents(t, otherRoot), nMis: 1,
			reason: mismatch(other) + fmt.Sprintf("the guest measured root hash %s for oci image %s, whose root hash is %s", otherRoot, img, ociRoot)},
		{name: "another root at ready, in learn mode", stage: ready, pcr15: other, events: verityEvents(t, otherRoot), learn: true, nMis: 1,
			reason: mismatch(other) + fmt.Sprintf("the guest measured root hash %s for oci image %s, whose root hash is %s", otherRoot, img, ociRoot)},
		{name: "the root measured twice", stage: initrd, pcr15: twice, events: verityEvents(t, ociRoot, ociRoot), nMis: 1,
			reason: mismatch(twice) + fmt.Sprintf("the guest measured root hashes %s, %s for oci image %s, whose root hash is %s", ociRoot, ociRoot, img, ociRoot)},
		{name: "another root, no log", stage: initrd, pcr15: other,
			reason: mismatch(other) + fmt.Sprintf("oci image %s has root hash %s, and the guest's log does not say which root it measured", img, ociRoot)},
		{name: "another root, a log that does not replay", stage: initrd, pcr15: other, events: verityEvents(t, ociRoot),
			reason: mismatch(other) + fmt.Sprintf("oci image %s has root hash %s, and the guest's log does not say which root it measured", img, ociRoot)},
		{name: "a record whose word is not what it measured", stage: initrd, pcr15: other, events: lying, nMis: 1,
			reason: mismatch(other) + fmt.Sprintf("oci image %s has root hash %s, and the guest's log does not say which root it measured; first differing event: verity-root %q (not what the digest measured) (expected %q)",
				img, ociRoot, measure.VerityRootWord(ociRoot), measure.VerityRootWord(ociRoot))},
		{name: "a claim its digest does not prove", stage: initrd, pcr15: other, events: claim, nMis: 1,
			reason: mismatch(other) + fmt.Sprintf("oci image %s has root hash %s, and the guest's log does not say which root it measured; first differing event: verity-root %q (expected %q)",
				img, ociRoot, measure.VerityRootWord(ociRoot), measure.VerityRootWord(ociRoot))},
		{name: "something else in pcr 15", stage: initrd, pcr15: foreign, events: []verify.Event{{PCR: 15, Type: verify.TypeUserspace, Description: `machine-id "machine-id:0123"`, Digest: measure.Digest([]byte("machine-id:0123"))}}, nMis: 1,
			reason: mismatch(foreign) + fmt.Sprintf("oci image %s has root hash %s, and the guest's log does not say which root it measured; first differing event: machine-id \"machine-id:0123\" (expected %q)", img, ociRoot, measure.VerityRootWord(ociRoot))},
		{name: "nothing measured", stage: initrd, pcr15: measure.Zero(), events: []verify.Event{},
			reason: mismatch(measure.Zero()) + fmt.Sprintf("the guest measured no verity root for oci image %s, whose root hash is %s", img, ociRoot)},
		{name: "nothing measured, at ready", stage: ready, pcr15: measure.Zero(),
			reason: mismatch(measure.Zero()) + fmt.Sprintf("the guest measured no verity root for oci image %s, whose root hash is %s", img, ociRoot)},
		{name: "pcr 15 not quoted", stage: initrd,
			reason: fmt.Sprintf("verity root mismatch: pcr 15 was not quoted, so the guest's root is unknown; oci image %s has root hash %s", img, ociRoot)},
		{name: "pcr 15 not quoted, learn mode", stage: ready, learn: true,
			reason: fmt.Sprintf("verity root mismatch: pcr 15 was not quoted, so the guest's root is unknown; oci image %s has root hash %s", img, ociRoot)},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out := Evaluate(doc(t, ociPolicy(ociRoot)), c.stage, "", true, "", ociQuote(c.stage, c.pcr15), c.events, c.learn)
			if out.Reason != c.reason {
				t.Fatalf("reason %q\nwant   %q", out.Reason, c.reason)
			}
			t.Logf("reason: %s", out.Reason)
			if out.OCI != nil || out.Summary != "" {
				t.Errorf("a rejection names oci image %v, summary %q", out.OCI, out.Summary)
			}
			if len(out.MismatchedEvents) != c.nMis {
				t.Errorf("%d mismatched events, want %d: %v", len(out.MismatchedEvents), c.nMis, out.MismatchedEvents)
			}
			for _, m := range out.MismatchedEvents {
				if m.GetPcr() != 15 {
					t.Errorf("mismatched event %v", m)
				}
			}
		})
	}
}

// A golden mismatch and a root mismatch are both named.
func TestOCIRootAndGoldenMismatch(t *testing.T) {
	initrd := attestationv1.Stage_STAGE_INITRD
	pcrs := ociQuote(initrd, measure.PCR15(otherRoot))
	pcrs[9] = digest(0x99)
	out := Evaluate(doc(t, ociPolicy(ociRoot)), initrd, "", true, "", pcrs, nil, false)
	if !strings.HasPrefix(out.Reason, "golden mismatch: pcr 9 expected "+hx(0x09)) || !strings.Contains(out.Reason, "; verity root mismatch: pcr 15 expected ") {
		t.Errorf("reason %q", out.Reason)
	}
}

// A policy without oci does not look at PCR 15, quoted or not.
func TestNonOCIPolicyIgnoresPCR15(t *testing.T) {
	for _, stage := range []attestationv1.Stage{attestationv1.Stage_STAGE_INITRD, attestationv1.Stage_STAGE_READY} {
		d := ociPolicy(ociRoot)
		delete(d, "oci")
		for _, pcr15 := range [][]byte{nil, measure.Zero(), measure.PCR15(otherRoot)} {
			out := Evaluate(doc(t, d), stage, "", true, "", ociQuote(stage, pcr15), verityEvents(t, otherRoot), false)
			if out.Reason != "" || out.OCI != nil || strings.Contains(out.Summary, "oci") {
				t.Errorf("%v, pcr 15 %x: reason %q, oci %v, summary %q", stage, pcr15, out.Reason, out.OCI, out.Summary)
			}
		}
	}
}

// A stored oci object that is not valid (import validates it) rejects
// every quote rather than verifying one without its root.
func TestInvalidOCIPolicyFailsClosed(t *testing.T) {
	d := ociPolicy("not hex")
	out := Evaluate(doc(t, d), attestationv1.Stage_STAGE_INITRD, "", true, "", ociQuote(attestationv1.Stage_STAGE_INITRD, measure.PCR15(ociRoot)), nil, false)
	if !strings.HasPrefix(out.Reason, "verity root mismatch: the image policy's oci object is invalid (") || out.OCI != nil {
		t.Errorf("reason %q, oci %v", out.Reason, out.OCI)
	}
	d["oci"] = "python:3.12"
	if out := Evaluate(doc(t, d), attestationv1.Stage_STAGE_INITRD, "", true, "", ociQuote(attestationv1.Stage_STAGE_INITRD, measure.PCR15(ociRoot)), nil, false); out.Reason == "" {
		t.Error("an oci that is no object verified")
	}
}
