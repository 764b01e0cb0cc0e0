package policy_test

import (
	"errors"
	"reflect"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policy"
	"google.golang.org/protobuf/types/known/structpb"
)

const ref = "flatcar_4230.2.0"

func hex32(c byte) string { return strings.Repeat(string([]byte{c, c}), 32) }

// full is a complete, valid policy.json as in contract §5.5.
func full() map[string]any {
	return map[string]any{
		"image_id":      "flatcar",
		"image_version": "4230.2.0",
		"uki":           "flatcar_4230.2.0.efi",
		"roothash":      "abc",
		"partitions":    []any{"root", "usr"},
		"pcr11": map[string]any{
			policy.PhaseInitrd: hex32('a'),
			policy.PhaseReady:  hex32('b'),
		},
		"pcr13": map[string]any{
			"v1.33.1": hex32('c'),
			"v1.34.0": hex32('d'),
		},
		"golden": map[string]any{
			"sha256": map[string]any{
				"0": hex32('0'), "2": hex32('2'), "3": hex32('3'), "4": hex32('4'),
				"6": hex32('6'), "7": hex32('7'), "13": hex32('1'),
			},
		},
		"golden_firmware": map[string]any{
			"sha256":  hex32('e'),
			"package": "ovmf-generic",
			"version": "2025.11-3ubuntu7.2",
		},
	}
}

func doc(t *testing.T, m map[string]any) *structpb.Struct {
	t.Helper()
	s, err := structpb.NewStruct(m)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func sub(m map[string]any, key string) map[string]any { return m[key].(map[string]any) }

// withOCI adds an imported OCI image's oci object, changed by mutate.
func withOCI(mutate func(o map[string]any)) func(m map[string]any) {
	return func(m map[string]any) {
		o := map[string]any{
			"reference":       "localhost:5000/python:3.12",
			"manifest_digest": "sha256:" + hex32('a'),
			"config_digest":   "sha256:" + hex32('b'),
			"root_hash":       hex32('5'),
		}
		mutate(o)
		m["oci"] = o
	}
}

func TestValidate(t *testing.T) {
	cases := []struct {
		name   string
		ref    string
		mutate func(m map[string]any)
		field  string // "" means valid
	}{
		{name: "full document", mutate: func(map[string]any) {}},
		{name: "empty document", mutate: func(m map[string]any) {
			for k := range m {
				delete(m, k)
			}
		}},
		{name: "no image id or version", mutate: func(m map[string]any) {
			delete(m, "image_id")
			delete(m, "image_version")
		}},
		{name: "only image id, other ref", ref: "other_1", mutate: func(m map[string]any) { delete(m, "image_version") }},
		{name: "uppercase hex", mutate: func(m map[string]any) { sub(m, "pcr11")[policy.PhaseInitrd] = strings.ToUpper(hex32('a')) }},
		{name: "golden index 23", mutate: func(m map[string]any) { sub(sub(m, "golden"), "sha256")["23"] = hex32('9') }},
		{name: "golden without sha256 bank", mutate: func(m map[string]any) { m["golden"] = map[string]any{} }},
		{name: "golden_firmware without sha256", mutate: func(m map[string]any) { delete(sub(m, "golden_firmware"), "sha256") }},

		{name: "missing initrd phase", field: "document.pcr11", mutate: func(m map[string]any) { delete(sub(m, "pcr11"), policy.PhaseInitrd) }},
		{name: "missing ready phase", field: "document.pcr11", mutate: func(m map[string]any) { delete(sub(m, "pcr11"), policy.PhaseReady) }},
		{name: "pcr11 not an object", field: "document.pcr11", mutate: func(m map[string]any) { m["pcr11"] = hex32('a') }},
		{name: "pcr11 non-hex", field: "document.pcr11", mutate: func(m map[string]any) { sub(m, "pcr11")[policy.PhaseReady] = strings.Repeat("zz", 32) }},
		{name: "pcr11 31 bytes", field: "document.pcr11", mutate: func(m map[string]any) { sub(m, "pcr11")[policy.PhaseReady] = strings.Repeat("ab", 31) }},
		{name: "pcr11 33 bytes", field: "document.pcr11", mutate: func(m map[string]any) { sub(m, "pcr11")[policy.PhaseReady] = strings.Repeat("ab", 33) }},
		{name: "pcr11 odd length", field: "document.pcr11", mutate: func(m map[string]any) { sub(m, "pcr11")[policy.PhaseReady] = hex32('a') + "a" }},
		{name: "pcr11 number digest", field: "document.pcr11", mutate: func(m map[string]any) { sub(m, "pcr11")[policy.PhaseReady] = 5 }},
		{name: "pcr11 extra phase bad digest", field: "document.pcr11", mutate: func(m map[string]any) { sub(m, "pcr11")["enter-initrd:leave-initrd"] = "x" }},
		{name: "pcr13 bad digest", field: "document.pcr13", mutate: func(m map[string]any) { sub(m, "pcr13")["v1.33.1"] = strings.Repeat("ab", 31) }},
		{name: "pcr13 not an object", field: "document.pcr13", mutate: func(m map[string]any) { m["pcr13"] = []any{} }},
		{name: "golden bank sha1", field: "document.golden", mutate: func(m map[string]any) {
			sub(m, "golden")["sha1"] = map[string]any{"0": strings.Repeat("ab", 20)}
		}},
		{name: "golden not an object", field: "document.golden", mutate: func(m map[string]any) { m["golden"] = "sha256" }},
		{name: "golden sha256 not an object", field: "document.golden.sha256", mutate: func(m map[string]any) { sub(m, "golden")["sha256"] = hex32('a') }},
		{name: "golden index 24", field: "document.golden.sha256", mutate: func(m map[string]any) { sub(sub(m, "golden"), "sha256")["24"] = hex32('9') }},
		{name: "golden index 07", field: "document.golden.sha256", mutate: func(m map[string]any) { sub(sub(m, "golden"), "sha256")["07"] = hex32('9') }},
		{name: "golden index x", field: "document.golden.sha256", mutate: func(m map[string]any) { sub(sub(m, "golden"), "sha256")["x"] = hex32('9') }},
		{name: "golden index -1", field: "document.golden.sha256", mutate: func(m map[string]any) { sub(sub(m, "golden"), "sha256")["-1"] = hex32('9') }},
		{name: "golden index +1", field: "document.golden.sha256", mutate: func(m map[string]any) { sub(sub(m, "golden"), "sha256")["+1"] = hex32('9') }},
		{name: "golden bad digest", field: "document.golden.sha256", mutate: func(m map[string]any) { sub(sub(m, "golden"), "sha256")["7"] = "00" }},
		{name: "image id mismatch", field: "document.image_id", mutate: func(m map[string]any) { m["image_id"] = "ubuntu" }},
		{name: "image version mismatch", field: "document.image_id", mutate: func(m map[string]any) { m["image_version"] = "4230.1.0" }},
		{name: "ref without version", ref: "flatcar", field: "document.image_id", mutate: func(map[string]any) {}},
		{name: "golden_firmware sha256 bad", field: "document.golden_firmware.sha256", mutate: func(m map[string]any) { sub(m, "golden_firmware")["sha256"] = "ovmf" }},
		{name: "golden_firmware sha256 31 bytes", field: "document.golden_firmware.sha256", mutate: func(m map[string]any) {
			sub(m, "golden_firmware")["sha256"] = strings.Repeat("ab", 31)
		}},
		{name: "golden_firmware not an object", field: "document.golden_firmware", mutate: func(m map[string]any) { m["golden_firmware"] = hex32('e') }},

		{name: "oci image", mutate: withOCI(func(map[string]any) {})},
		{name: "oci upper-case root hash", mutate: withOCI(func(o map[string]any) { o["root_hash"] = strings.ToUpper(hex32('5')) })},
		{name: "oci reference with a digest", mutate: withOCI(func(o map[string]any) { o["reference"] = "registry.example/a/b@" + o["manifest_digest"].(string) })},
		{name: "oci unknown field kept", mutate: withOCI(func(o map[string]any) { o["platform"] = "linux/amd64" })},
		{name: "oci not an object", field: "document.oci", mutate: func(m map[string]any) { m["oci"] = "localhost:5000/python:3.12" }},
		{name: "oci empty", field: "document.oci.reference", mutate: func(m map[string]any) { m["oci"] = map[string]any{} }},
		{name: "oci reference missing", field: "document.oci.reference", mutate: withOCI(func(o map[string]any) { delete(o, "reference") })},
		{name: "oci reference empty", field: "document.oci.reference", mutate: withOCI(func(o map[string]any) { o["reference"] = "" })},
		{name: "oci reference a number", field: "document.oci.reference", mutate: withOCI(func(o map[string]any) { o["reference"] = 5 })},
		{name: "oci reference too long", field: "document.oci.reference", mutate: withOCI(func(o map[string]any) { o["reference"] = "r/" + strings.Repeat("a", policy.MaxOCIReference) })},
		{name: "oci reference with a space", field: "document.oci.reference", mutate: withOCI(func(o map[string]any) { o["reference"] = "python:3.12 other" })},
		{name: "oci reference with a newline", field: "document.oci.reference", mutate: withOCI(func(o map[string]any) { o["reference"] = "python:3.12\nverified" })},
		{name: "oci manifest_digest missing", field: "document.oci.manifest_digest", mutate: withOCI(func(o map[string]any) { delete(o, "manifest_digest") })},
		{name: "oci manifest_digest bare hex", field: "document.oci.manifest_digest", mutate: withOCI(func(o map[string]any) { o["manifest_digest"] = hex32('a') })},
		{name: "oci manifest_digest sha512", field: "document.oci.manifest_digest", mutate: withOCI(func(o map[string]any) { o["manifest_digest"] = "sha512:" + hex32('a') + hex32('a') })},
		{name: "oci manifest_digest upper case", field: "document.oci.manifest_digest", mutate: withOCI(func(o map[string]any) { o["manifest_digest"] = "sha256:" + hex32('A') })},
		{name: "oci manifest_digest 31 bytes", field: "document.oci.manifest_digest", mutate: withOCI(func(o map[string]any) { o["manifest_digest"] = "sha256:" + strings.Repeat("ab", 31) })},
		{name: "oci config_digest missing", field: "document.oci.config_digest", mutate: withOCI(func(o map[string]any) { delete(o, "config_digest") })},
		{name: "oci config_digest not hex", field: "document.oci.config_digest", mutate: withOCI(func(o map[string]any) { o["config_digest"] = "sha256:" + strings.Repeat("zz", 32) })},
		{name: "oci root_hash missing", field: "document.oci.root_hash", mutate: withOCI(func(o map[string]any) { delete(o, "root_hash") })},
		{name: "oci root_hash 31 bytes", field: "document.oci.root_hash", mutate: withOCI(func(o map[string]any) { o["root_hash"] = strings.Repeat("ab", 31) })},
		{name: "oci root_hash with sha256:", field: "document.oci.root_hash", mutate: withOCI(func(o map[string]any) { o["root_hash"] = "sha256:" + hex32('5') })},
		{name: "oci root_hash a list", field: "document.oci.root_hash", mutate: withOCI(func(o map[string]any) { o["root_hash"] = []any{hex32('5')} })},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := full()
			c.mutate(m)
			r := c.ref
			if r == "" {
				r = ref
			}
			err := policy.Validate(r, doc(t, m))
			if c.field == "" {
				if err != nil {
					t.Fatalf("Validate = %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate accepted an invalid document")
			}
			if got := apierr.CodeOf(err); got != apierr.InvalidRequest {
				t.Errorf("CodeOf = %q, want invalid_request (err %v)", got, err)
			}
			if !errors.Is(err, apierr.ErrInvalid) {
				t.Errorf("errors.Is(err, ErrInvalid) = false")
			}
			var e *apierr.Error
			if !errors.As(err, &e) || e.Metadata["field"] != c.field {
				t.Errorf("field = %v, want %q (err %v)", e.Metadata, c.field, err)
			}
		})
	}
}

func TestValidateMessages(t *testing.T) {
	m := full()
	delete(sub(m, "pcr11"), policy.PhaseReady)
	err := policy.Validate(ref, doc(t, m))
	if err == nil || !strings.Contains(err.Error(), `"enter-initrd:leave-initrd:sysinit:ready"`) {
		t.Errorf("missing phase message = %v", err)
	}
	m = full()
	m["image_id"] = "ubuntu"
	err = policy.Validate(ref, doc(t, m))
	if err == nil || !strings.Contains(err.Error(), "ubuntu_4230.2.0") || !strings.Contains(err.Error(), ref) {
		t.Errorf("mismatch message = %v", err)
	}
	m = full()
	sub(m, "golden")["sha1"] = map[string]any{}
	err = policy.Validate(ref, doc(t, m))
	if err == nil || !strings.Contains(err.Error(), `"sha1"`) {
		t.Errorf("bank message = %v", err)
	}
}

func TestValidateNil(t *testing.T) {
	err := policy.Validate(ref, nil)
	if err == nil {
		t.Fatal("nil document accepted")
	}
	if apierr.CodeOf(err) != apierr.InvalidRequest {
		t.Errorf("CodeOf = %q", apierr.CodeOf(err))
	}
}

func TestGoldenPCRs(t *testing.T) {
	got := policy.GoldenPCRs(doc(t, full()))
	want := []uint32{0, 2, 3, 4, 6, 7, 13}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("GoldenPCRs = %v, want %v", got, want)
	}
	m := full()
	sub(sub(m, "golden"), "sha256")["23"] = hex32('9')
	sub(sub(m, "golden"), "sha256")["1"] = hex32('9')
	if got := policy.GoldenPCRs(doc(t, m)); !reflect.DeepEqual(got, []uint32{0, 1, 2, 3, 4, 6, 7, 13, 23}) {
		t.Errorf("GoldenPCRs = %v", got)
	}
	m = full()
	delete(m, "golden")
	if got := policy.GoldenPCRs(doc(t, m)); len(got) != 0 {
		t.Errorf("GoldenPCRs without golden = %v", got)
	}
	if got := policy.GoldenPCRs(nil); len(got) != 0 {
		t.Errorf("GoldenPCRs(nil) = %v", got)
	}
}
