package verifier

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/measure"
	"google.golang.org/protobuf/types/known/structpb"
)

var (
	ociRoot     = hex.EncodeToString(measure.Digest([]byte("python:3.12 erofs root")))
	ociManifest = "sha256:" + hex.EncodeToString(measure.Digest([]byte("manifest")))
	ociConfig   = "sha256:" + hex.EncodeToString(measure.Digest([]byte("config")))
)

const ociRef = "localhost:5000/python:3.12"

// ociRig is a rig whose image is an imported OCI image: its policy has the
// oci object the hypervisor writes at import.
func ociRig(t *testing.T, opts Options) *rig {
	r := newRig(t, opts)
	r.pols.policies[img].Document.Fields["oci"] = structpb.NewStructValue(doc(t, map[string]any{
		"reference": ociRef, "manifest_digest": ociManifest, "config_digest": ociConfig, "root_hash": ociRoot,
	}))
	return r
}

// withRoot is a quote's PCRs at stage with PCR 15 after vm-agent measured
// root, and vm-agent's log of it.
func withRoot(t *testing.T, stage attestationv1.Stage, root string) (map[uint32][]byte, []byte) {
	pcrs := zeros(stage)
	pcrs[measure.PCRVerityRoot] = measure.PCR15(root)
	var log bytes.Buffer
	if err := measure.WriteRecord(&log, measure.WordRecord(measure.PCRVerityRoot, measure.VerityRootWord(root), measure.EventTypeVerityRoot, "boot", 1)); err != nil {
		t.Fatal(err)
	}
	return pcrs, log.Bytes()
}

// A VM booted from an imported OCI image is verified by its root's content,
// and the verdict, as recorded, names the image.
func TestOCIImageVerifiedByItsRoot(t *testing.T) {
	r := ociRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	for _, stage := range []attestationv1.Stage{initrd, ready} {
		pcrs, log := withRoot(t, stage, ociRoot)
		sub := r.quote(r.ak, stage, r.nonce(), pcrs)
		sub.UserspaceLog = log
		v := r.verify(sub)
		expect(t, v, true, fmt.Sprintf(", oci %s@%s root %s", ociRef, ociManifest, ociRoot))
		recorded := r.vms.att(vmA).GetInitrd()
		if stage == ready {
			recorded = r.vms.att(vmA).GetReady()
		}
		for _, q := range []*attestationv1.Quote{v.Quote, recorded, v.Attestation.GetInitrd()} {
			o := q.GetOci()
			if o.GetReference() != ociRef || o.GetManifestDigest() != ociManifest || o.GetConfigDigest() != ociConfig || o.GetRootHash() != ociRoot {
				t.Errorf("%v: verdict names oci image %v", stage, o)
			}
		}
	}
}

// The security property: a VM whose root is not the image's is refused,
// naming both root hashes, and its user-data stays gated.
func TestOCIImageWithAnotherRootIsRefused(t *testing.T) {
	other := hex.EncodeToString(measure.Digest([]byte("a root with a backdoor")))
	want := measure.PCR15(ociRoot)
	for _, c := range []struct {
		name   string
		pcrs   func() (map[uint32][]byte, []byte)
		reason string
	}{
		{"another root", func() (map[uint32][]byte, []byte) { return withRoot(t, initrd, other) },
			fmt.Sprintf("verity root mismatch: pcr 15 expected %x, got %x; the guest measured root hash %s for oci image %s@%s, whose root hash is %s",
				want, measure.PCR15(other), other, ociRef, ociManifest, ociRoot)},
		{"no root measured", func() (map[uint32][]byte, []byte) {
			p := zeros(initrd)
			p[15] = measure.Zero()
			return p, nil
		}, fmt.Sprintf("verity root mismatch: pcr 15 expected %x, got %x; the guest measured no verity root for oci image %s@%s, whose root hash is %s",
			want, measure.Zero(), ociRef, ociManifest, ociRoot)},
		{"pcr 15 not quoted (a guest from before it was)", func() (map[uint32][]byte, []byte) { return zeros(initrd), nil },
			fmt.Sprintf("verity root mismatch: pcr 15 was not quoted, so the guest's root is unknown; oci image %s@%s has root hash %s", ociRef, ociManifest, ociRoot)},
	} {
		t.Run(c.name, func(t *testing.T) {
			for _, learn := range []bool{false, true} {
				r := ociRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY, LearnGolden: learn})
				pcrs, log := c.pcrs()
				sub := r.quote(r.ak, initrd, r.nonce(), pcrs)
				sub.UserspaceLog = log
				v := r.verify(sub)
				if v.Quote.GetVerified() || v.Quote.GetMessage() != c.reason {
					t.Fatalf("learn %v: verdict %v %q\nwant reason       %q", learn, v.Quote.GetVerified(), v.Quote.GetMessage(), c.reason)
				}
				if v.UserDataReleased || r.vms.att(vmA).GetUserDataReleased() || v.Quote.GetOci() != nil {
					t.Errorf("learn %v: a rejected root released user-data or named its image: %v", learn, v.Quote)
				}
			}
		})
	}
}

// An image that is not an OCI import is judged as before: with or without
// PCR 15 in the quote, whatever it holds.
func TestNonOCIImageIgnoresPCR15(t *testing.T) {
	r := newRig(t, Options{Mode: attestationv1.Mode_MODE_VERIFY})
	expect(t, r.verify(r.quote(r.ak, initrd, r.nonce(), zeros(initrd))), true, "verified")
	pcrs, log := withRoot(t, ready, ociRoot)
	sub := r.quote(r.ak, ready, r.nonce(), pcrs)
	sub.UserspaceLog = log
	v := r.verify(sub)
	expect(t, v, true, "verified")
	if v.Quote.GetOci() != nil {
		t.Errorf("a non-OCI image's verdict names %v", v.Quote.GetOci())
	}
}
