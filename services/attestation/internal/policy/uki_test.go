package policy_test

import (
	"encoding/hex"
	"errors"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policy"
)

// ukiDoc is a consistent UKI image policy, as the image builder writes it:
// pcr11 from uki.sections, pcr13 from sysext.
func ukiDoc(t *testing.T) map[string]any {
	t.Helper()
	sections := map[string][]byte{
		".linux": measure.Digest([]byte("kernel")), ".osrel": measure.Digest([]byte("ID=test")),
		".cmdline": measure.Digest([]byte("console=ttyS0")), ".initrd": measure.Digest([]byte("initrd")),
	}
	secHex := map[string]any{}
	for k, v := range sections {
		secHex[k] = hex.EncodeToString(v)
	}
	p11 := map[string]any{}
	for _, phase := range []string{policy.PhaseInitrd, policy.PhaseReady} {
		v, err := measure.PCR11(sections, phase)
		if err != nil {
			t.Fatal(err)
		}
		p11[phase] = hex.EncodeToString(v)
	}
	raw := hex.EncodeToString(measure.Digest([]byte("kubernetes_1.31.4.raw bytes")))
	return map[string]any{
		"image_id": "flatcar", "image_version": "4230.2.0",
		"uki":    map[string]any{"sections": secHex},
		"sysext": map[string]any{"1.31.4": raw},
		"pcr11":  p11,
		"pcr13":  map[string]any{"1.31.4": hex.EncodeToString(measure.PCR13(measure.SysextLine(raw, measure.SysextFile("1.31.4"))))},
	}
}

func TestValidateUKI(t *testing.T) {
	sections := func(m map[string]any) map[string]any { return sub(sub(m, "uki"), "sections") }
	cases := []struct {
		name   string
		mutate func(m map[string]any)
		field  string // "" means valid
		msg    string
	}{
		{name: "consistent", mutate: func(map[string]any) {}},
		{name: "uppercase section hex", mutate: func(m map[string]any) {
			sections(m)[".linux"] = strings.ToUpper(sections(m)[".linux"].(string))
		}},
		{name: "uppercase sysext hex", mutate: func(m map[string]any) {
			sub(m, "sysext")["1.31.4"] = strings.ToUpper(sub(m, "sysext")["1.31.4"].(string))
		}},
		{name: "sections without pcr11", mutate: func(m map[string]any) { delete(m, "pcr11") }},
		{name: "authenticode of the applications", mutate: func(m map[string]any) {
			sub(m, "uki")["authenticode"] = map[string]any{"uki": hex32('a'), "linux": hex32('b')}
		}},
		{name: "authenticode not hex", mutate: func(m map[string]any) {
			sub(m, "uki")["authenticode"] = map[string]any{"uki": "zz"}
		}, field: "document.uki.authenticode", msg: `uki.authenticode["uki"] is not 32 bytes of hex`},
		{name: "sysext for a version pcr13 lacks", mutate: func(m map[string]any) { sub(m, "sysext")["1.32.0"] = hex32('a') }},
		{name: "uki without sections", mutate: func(m map[string]any) { m["uki"] = map[string]any{} }},
		{name: "uki as a file name", mutate: func(m map[string]any) { m["uki"] = "flatcar_4230.2.0.efi" }},

		{name: "unknown section", field: "document.uki.sections", msg: `uki.sections[".text"] is not a section systemd-stub measures`,
			mutate: func(m map[string]any) { sections(m)[".text"] = hex32('a') }},
		{name: "section bad hex", field: "document.uki.sections", msg: `uki.sections[".cmdline"] is not 32 bytes of hex`,
			mutate: func(m map[string]any) { sections(m)[".cmdline"] = strings.Repeat("zz", 32) }},
		{name: "section 31 bytes", field: "document.uki.sections", msg: "is not 32 bytes of hex",
			mutate: func(m map[string]any) { sections(m)[".initrd"] = strings.Repeat("ab", 31) }},
		{name: "sections not an object", field: "document.uki.sections", msg: "uki.sections must be an object",
			mutate: func(m map[string]any) { sub(m, "uki")["sections"] = []any{".linux"} }},
		{name: "sysext bad hex", field: "document.sysext", msg: `sysext["1.31.4"] is not 32 bytes of hex`,
			mutate: func(m map[string]any) { sub(m, "sysext")["1.31.4"] = "abc" }},
		{name: "sysext not an object", field: "document.sysext", msg: "sysext must be an object",
			mutate: func(m map[string]any) { m["sysext"] = hex32('a') }},
		{name: "pcr11 initrd inconsistent with sections", field: "document.pcr11", msg: `pcr11["enter-initrd"] is ` + hex32('a') + `, but uki.sections give`,
			mutate: func(m map[string]any) { sub(m, "pcr11")[policy.PhaseInitrd] = hex32('a') }},
		{name: "pcr11 ready inconsistent with sections", field: "document.pcr11", msg: `pcr11["enter-initrd:leave-initrd:sysinit:ready"]`,
			mutate: func(m map[string]any) { sub(m, "pcr11")[policy.PhaseReady] = hex32('b') }},
		{name: "a changed section", field: "document.pcr11", msg: `pcr11["enter-initrd"]`,
			mutate: func(m map[string]any) { sections(m)[".cmdline"] = hex32('c') }},
		{name: "a section too many", field: "document.pcr11", msg: `pcr11["enter-initrd"]`,
			mutate: func(m map[string]any) { sections(m)[".splash"] = hex32('c') }},
		{name: "sysext inconsistent with pcr13", field: "document.pcr13", msg: `pcr13["1.31.4"] is ` + hex32('d') + `, but sysext["1.31.4"] gives`,
			mutate: func(m map[string]any) { sub(m, "pcr13")["1.31.4"] = hex32('d') }},
		{name: "a changed sysext", field: "document.pcr13", msg: `"` + hex32('e') + `  kubernetes_1.31.4.raw"`,
			mutate: func(m map[string]any) { sub(m, "sysext")["1.31.4"] = hex32('e') }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			m := ukiDoc(t)
			c.mutate(m)
			err := policy.Validate(ref, doc(t, m))
			if c.field == "" {
				if err != nil {
					t.Fatalf("Validate = %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Validate accepted an invalid document")
			}
			var e *apierr.Error
			if apierr.CodeOf(err) != apierr.InvalidRequest || !errors.As(err, &e) || e.Metadata["field"] != c.field {
				t.Errorf("err %v (code %s), want invalid_request on %s", err, apierr.CodeOf(err), c.field)
			}
			if !strings.Contains(err.Error(), c.msg) {
				t.Errorf("message %q, want %q", err, c.msg)
			}
		})
	}
}
