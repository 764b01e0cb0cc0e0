package policy

import (
	"encoding/hex"
	"maps"
	"slices"
	"strings"

	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/protobuf/types/known/structpb"
)

// validateUKI checks uki.sections and sysext, and that pcr11 and pcr13 are
// what they compute: the image builder writes both, and a document whose
// values disagree would name the wrong events on a mismatch. A "uki" that is
// no object is the UKI's file name, as earlier documents have it, and is
// left alone.
func validateUKI(f map[string]*structpb.Value) error {
	if u := f["uki"].GetStructValue(); u != nil {
		m, ok, err := object(u.GetFields(), "sections", "uki.sections", "an object of section name to hex digest")
		if err != nil {
			return err
		}
		if ok {
			for _, name := range slices.Sorted(maps.Keys(m.GetFields())) {
				if !slices.Contains(measure.Sections, name) {
					return apierr.Invalidf("document.uki.sections", "uki.sections[%q] is not a section systemd-stub measures (%s)", name, strings.Join(measure.Sections, ", "))
				}
			}
			if err := digests("uki.sections", m); err != nil {
				return err
			}
		}
		if err := digestObject(u.GetFields(), "authenticode", "uki.authenticode", "an object of EFI application to the hex sha256 of its Authenticode hash"); err != nil {
			return err
		}
	}
	if err := digestObject(f, "sysext", "sysext", "an object of kubernetes version to the hex sha256 of its kubernetes_<version>.raw"); err != nil {
		return err
	}

	doc := &structpb.Struct{Fields: f}
	if sections, ok := sectionDigests(doc); ok {
		p11 := f["pcr11"].GetStructValue().GetFields()
		for _, phase := range slices.Sorted(maps.Keys(p11)) {
			want, err := measure.PCR11(sections, phase)
			if err != nil {
				return apierr.Invalidf("document.uki.sections", "uki.sections: %v", err)
			}
			if got := p11[phase].GetStringValue(); !equalHex(got, want) {
				return apierr.Invalidf("document.pcr11", "pcr11[%q] is %s, but uki.sections give %x for that phase", phase, strings.ToLower(got), want)
			}
		}
	}
	p13 := f["pcr13"].GetStructValue().GetFields()
	for _, v := range slices.Sorted(maps.Keys(f["sysext"].GetStructValue().GetFields())) {
		got, ok := p13[v]
		if !ok {
			continue
		}
		line, _ := sysextLine(doc, v)
		if want := measure.PCR13(line); !equalHex(got.GetStringValue(), want) {
			return apierr.Invalidf("document.pcr13", "pcr13[%q] is %s, but sysext[%q] gives %x (SHA256SUMS line %q)", v, strings.ToLower(got.GetStringValue()), v, want, line)
		}
	}
	return nil
}

// sectionDigests are the document's uki.sections, decoded; ok is false when
// it has none or they do not decode (a document stored before they were
// validated).
func sectionDigests(doc *structpb.Struct) (map[string][]byte, bool) {
	u := doc.GetFields()["uki"].GetStructValue()
	if u == nil {
		return nil, false
	}
	m := u.GetFields()["sections"].GetStructValue()
	if m == nil {
		return nil, false
	}
	out := make(map[string][]byte, len(m.GetFields()))
	for name, v := range m.GetFields() {
		d, err := hex.DecodeString(v.GetStringValue())
		if err != nil || len(d) != 32 || !slices.Contains(measure.Sections, name) {
			return nil, false
		}
		out[name] = d
	}
	return out, true
}

// sysextLine is the SHA256SUMS line of sysext[kubernetesVersion], the word
// PCR 13 holds for it; ok is false when the document has no valid one.
func sysextLine(doc *structpb.Struct, kubernetesVersion string) (string, bool) {
	v, ok := doc.GetFields()["sysext"].GetStructValue().GetFields()[kubernetesVersion]
	if !ok || kubernetesVersion == "" || !isDigest(v.GetStringValue()) {
		return "", false
	}
	return measure.SysextLine(v.GetStringValue(), measure.SysextFile(kubernetesVersion)), true
}
