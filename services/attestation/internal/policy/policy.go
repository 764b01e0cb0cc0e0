// Package policy validates an image's policy.json (contract §5.5): the PCR 11
// values per boot phase and the UKI sections they come from, PCR 13 per
// Kubernetes version and the sysext hashes it comes from, golden sha256 PCRs
// and the firmware they were recorded on, and an imported OCI image's
// identity and dm-verity root hash, which PCR 15 must hold.
package policy

import (
	"encoding/hex"
	"sort"
	"strconv"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/protobuf/types/known/structpb"
)

// The two boot phases systemd-stub measures into PCR 11 that quotes are checked at.
const (
	PhaseInitrd = "enter-initrd"
	PhaseReady  = "enter-initrd:leave-initrd:sysinit:ready"
)

// Validate checks a policy document for image ref (<id>_<version>).
func Validate(ref string, doc *structpb.Struct) error {
	if doc == nil {
		return apierr.Invalidf("document", "policy document is required")
	}
	f := doc.GetFields()
	id, hasID := stringField(f, "image_id")
	ver, hasVer := stringField(f, "image_version")
	if hasID && hasVer && id+"_"+ver != ref {
		return apierr.Invalidf("document.image_id", "policy is for image %s_%s, not %s", id, ver, ref)
	}
	if m, ok, err := object(f, "pcr11", "pcr11", "an object of phase to hex digest"); err != nil {
		return err
	} else if ok {
		for _, phase := range []string{PhaseInitrd, PhaseReady} {
			if _, ok := m.GetFields()[phase]; !ok {
				return apierr.Invalidf("document.pcr11", "pcr11 lacks phase %q", phase)
			}
		}
		if err := digests("pcr11", m); err != nil {
			return err
		}
	}
	if err := digestObject(f, "pcr13", "pcr13", "an object of kubernetes version to hex digest"); err != nil {
		return err
	}
	if err := validateUKI(f); err != nil {
		return err
	}
	if _, _, err := ociImage(f); err != nil {
		return err
	}
	if g, ok, err := object(f, "golden", "golden", "an object with a sha256 bank"); err != nil {
		return err
	} else if ok {
		for bank := range g.GetFields() {
			if bank != "sha256" {
				return apierr.Invalidf("document.golden", "golden bank %q is not allowed; only sha256", bank)
			}
		}
		if m, ok, err := object(g.GetFields(), "sha256", "golden.sha256", "an object of PCR index to hex digest"); err != nil {
			return err
		} else if ok {
			for idx := range m.GetFields() {
				n, err := strconv.Atoi(idx)
				if err != nil || n < 0 || n > 23 || strconv.Itoa(n) != idx {
					return apierr.Invalidf("document.golden.sha256", "golden PCR index %q is not 0..23", idx)
				}
			}
			if err := digests("golden.sha256", m); err != nil {
				return err
			}
		}
	}
	if fw, ok, err := object(f, "golden_firmware", "golden_firmware", "an object"); err != nil {
		return err
	} else if ok {
		if s, ok := stringField(fw.GetFields(), "sha256"); ok && !isDigest(s) {
			return apierr.Invalidf("document.golden_firmware.sha256", "golden_firmware.sha256 is not 32 bytes of hex")
		}
	}
	return nil
}

// Enforces refuses a policy with neither golden sha256 PCRs nor pcr11
// values: outside learn mode it would reject every quote, in learn mode it
// would accept every one; neither is a policy. It judges the document as
// stored, after an import kept golden values recorded earlier.
func Enforces(ref string, doc *structpb.Struct) error {
	if len(GoldenPCRs(doc)) == 0 && doc.GetFields()["pcr11"] == nil {
		return apierr.Invalidf("document", "policy for %s enforces nothing: it has neither golden sha256 PCRs nor pcr11 values (record golden values from a learn-mode VM with RecordGolden, which creates the policy)", ref)
	}
	return nil
}

// GoldenPCRs lists the indexes with a golden sha256 value, ascending.
func GoldenPCRs(doc *structpb.Struct) []uint32 {
	var out []uint32
	bank := doc.GetFields()["golden"].GetStructValue().GetFields()["sha256"].GetStructValue()
	for idx := range bank.GetFields() {
		if n, err := strconv.Atoi(idx); err == nil {
			out = append(out, uint32(n))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// digestObject checks an optional object of names to hex digests (object,
// then digests).
func digestObject(f map[string]*structpb.Value, key, path, what string) error {
	m, ok, err := object(f, key, path, what)
	if err != nil || !ok {
		return err
	}
	return digests(path, m)
}

// object is the object at f[key]; ok is false when there is none, and a
// value that is no object is an error saying what it must be.
// field is its name in the document for messages.
func object(f map[string]*structpb.Value, key, field, must string) (m *structpb.Struct, ok bool, err error) {
	v, ok := f[key]
	if !ok {
		return nil, false, nil
	}
	if m = v.GetStructValue(); m == nil {
		return nil, true, apierr.Invalidf("document."+field, "%s must be %s", field, must)
	}
	return m, true, nil
}

func stringField(f map[string]*structpb.Value, key string) (string, bool) {
	v, ok := f[key]
	if !ok {
		return "", false
	}
	s, isStr := v.GetKind().(*structpb.Value_StringValue)
	if !isStr {
		return "", false
	}
	return s.StringValue, true
}

func digests(where string, m *structpb.Struct) error {
	for k, v := range m.GetFields() {
		s, ok := v.GetKind().(*structpb.Value_StringValue)
		if !ok || !isDigest(s.StringValue) {
			return apierr.Invalidf("document."+where, "%s[%q] is not 32 bytes of hex", where, k)
		}
	}
	return nil
}

func isDigest(s string) bool {
	b, err := hex.DecodeString(s)
	return err == nil && len(b) == 32
}
