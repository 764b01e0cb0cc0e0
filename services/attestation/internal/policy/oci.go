package policy

import (
	"bytes"
	"fmt"
	"strconv"
	"strings"
	"unicode"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
	"google.golang.org/protobuf/types/known/structpb"
)

// MaxOCIReference bounds oci.reference: a registry host, a repository
// name (at most 255 characters) and a tag or digest fit well within it.
const MaxOCIReference = 512

// OCI is what an imported OCI image's policy says about it (the document's
// "oci" object, written by the hypervisor at import): where it came from and
// the dm-verity root hash of the erofs root it was imported into, which
// vm-agent measures into PCR 15 (measure.PCRVerityRoot).
type OCI struct {
	Reference      string
	ManifestDigest string
	ConfigDigest   string
	RootHash       string // lower-case hex
}

// Name is how messages name the image: reference@manifest_digest.
func (o OCI) Name() string { return o.Reference + "@" + o.ManifestDigest }

// Proto is the image as a verdict names it.
func (o OCI) Proto() *attestationv1.OciImage {
	return &attestationv1.OciImage{Reference: o.Reference, ManifestDigest: o.ManifestDigest, ConfigDigest: o.ConfigDigest, RootHash: o.RootHash}
}

// ociImage reads the document's oci object; ok is false when there is
// none. A malformed one is an apierr.Invalidf naming its field.
func ociImage(f map[string]*structpb.Value) (img OCI, ok bool, err error) {
	m, ok, err := object(f, "oci", "oci", "an object with reference, manifest_digest, config_digest and root_hash")
	if err != nil || !ok {
		return OCI{}, ok, err
	}
	g := m.GetFields()
	field := func(key string) (string, error) {
		if _, present := g[key]; !present {
			return "", apierr.Invalidf("document.oci."+key, "oci lacks %s", key)
		}
		s, isStr := stringField(g, key)
		if !isStr {
			return "", apierr.Invalidf("document.oci."+key, "oci.%s must be a string", key)
		}
		return s, nil
	}
	if img.Reference, err = field("reference"); err != nil {
		return OCI{}, true, err
	}
	switch {
	case img.Reference == "":
		return OCI{}, true, apierr.Invalidf("document.oci.reference", "oci.reference is empty")
	case len(img.Reference) > MaxOCIReference:
		return OCI{}, true, apierr.Invalidf("document.oci.reference", "oci.reference is %d bytes, more than %d", len(img.Reference), MaxOCIReference)
	case strings.IndexFunc(img.Reference, func(r rune) bool { return !unicode.IsPrint(r) || unicode.IsSpace(r) }) >= 0:
		return OCI{}, true, apierr.Invalidf("document.oci.reference", "oci.reference %s has a space or an unprintable character", strconv.Quote(img.Reference))
	}
	for _, d := range []struct {
		key string
		to  *string
	}{{"manifest_digest", &img.ManifestDigest}, {"config_digest", &img.ConfigDigest}} {
		if *d.to, err = field(d.key); err != nil {
			return OCI{}, true, err
		}
		if !isOCIDigest(*d.to) {
			return OCI{}, true, apierr.Invalidf("document.oci."+d.key, "oci.%s is not sha256:<64 lower-case hex>", d.key)
		}
	}
	if img.RootHash, err = field("root_hash"); err != nil {
		return OCI{}, true, err
	}
	if !isDigest(img.RootHash) {
		return OCI{}, true, apierr.Invalidf("document.oci.root_hash", "oci.root_hash is not 32 bytes of hex")
	}
	img.RootHash = strings.ToLower(img.RootHash)
	return img, true, nil
}

// isOCIDigest: "sha256:" and 64 lower-case hex digits, as the OCI image
// spec writes a sha256 digest.
func isOCIDigest(s string) bool {
	h, ok := strings.CutPrefix(s, "sha256:")
	return ok && isDigest(h) && strings.ToLower(h) == h
}

// verityRoot checks PCR 15 of an OCI image's quote: it must be quoted and
// hold the verity root word of the policy's root hash, and nothing else
// (measure.PCR15), at every stage. img is nil when the policy has no oci
// object; reason is empty when PCR 15 matches. events are the replayed log
// events, as Evaluate takes them: when they extend PCR 15 to its quoted
// value, the reason names the root hash the guest measured, and ms the
// events that differ from the one expected.
func verityRoot(doc *structpb.Struct, pcrs map[uint32][]byte, events []verify.Event) (img *OCI, reason string, ms []*attestationv1.EventMismatch) {
	o, ok, err := ociImage(doc.GetFields())
	if !ok {
		return nil, "", nil
	}
	if err != nil {
		// Import validates it; fail closed on a document that got past.
		return nil, fmt.Sprintf("verity root mismatch: the image policy's oci object is invalid (%v): re-import the image's policy.json", err), nil
	}
	want := measure.PCR15(o.RootHash)
	got, quoted := pcrs[measure.PCRVerityRoot]
	switch {
	case !quoted:
		return &o, fmt.Sprintf("verity root mismatch: pcr 15 was not quoted, so the guest's root is unknown; oci image %s has root hash %s", o.Name(), o.RootHash), nil
	case bytes.Equal(got, want):
		return &o, "", nil
	}
	reason = fmt.Sprintf("verity root mismatch: pcr 15 expected %x, got %x; ", want, got)
	if bytes.Equal(got, measure.Zero()) {
		return &o, reason + fmt.Sprintf("the guest measured no verity root for oci image %s, whose root hash is %s", o.Name(), o.RootHash), nil
	}
	var first string
	var differs bool
	if events != nil {
		ms, first, differs = nameEvents(measure.PCRVerityRoot, measure.PCR15Events(o.RootHash), 0, events, got)
	}
	if roots, named := measuredRoots(events, got); named {
		s := ""
		if len(roots) > 1 {
			s = "es"
		}
		return &o, reason + fmt.Sprintf("the guest measured root hash%s %s for oci image %s, whose root hash is %s", s, strings.Join(roots, ", "), o.Name(), o.RootHash), ms
	}
	reason += fmt.Sprintf("oci image %s has root hash %s, and the guest's log does not say which root it measured", o.Name(), o.RootHash)
	if differs {
		reason += "; first differing event: " + first
	}
	return &o, reason, ms
}

// measuredRoots are the root hashes of the verity root words the guest
// extended into PCR 15, in order. named is false unless the replayed PCR 15
// events extend it from zero to its quoted value and every one of them is a
// verity root word its digest proves (the record's word is only a claim).
func measuredRoots(replayed []verify.Event, quoted []byte) (roots []string, named bool) {
	fold := measure.Zero()
	for _, e := range replayed {
		if e.PCR != measure.PCRVerityRoot {
			continue
		}
		fold = measure.Extend(fold, e.Digest)
		word, ok := recordWord(e.Description)
		h, isRoot := strings.CutPrefix(word, measure.VerityRootPrefix)
		if !ok || !isRoot || !isDigest(h) || !bytes.Equal(measure.Digest([]byte(word)), e.Digest) {
			return nil, false
		}
		roots = append(roots, h)
	}
	if len(roots) == 0 || !bytes.Equal(fold, quoted) {
		return nil, false
	}
	return roots, true
}

// recordWord is the word of a userspace log event's description
// (measure.ParseLog: `<event type> "<word>"`, or the quoted word alone).
func recordWord(desc string) (string, bool) {
	if !strings.HasPrefix(desc, `"`) {
		_, desc, _ = strings.Cut(desc, " ")
	}
	w, err := strconv.Unquote(desc)
	if err != nil {
		return "", false
	}
	return w, true
}
