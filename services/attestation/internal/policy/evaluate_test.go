package policy

import (
	"bytes"
	"encoding/hex"
	"strings"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/measure"
	"google.golang.org/protobuf/types/known/structpb"
)

func digest(b byte) []byte { return bytes.Repeat([]byte{b}, 32) }
func hx(b byte) string     { return hex.EncodeToString(digest(b)) }

func quoted(stage attestationv1.Stage) map[uint32][]byte {
	p := map[uint32][]byte{}
	for i := uint32(0); i <= 7; i++ {
		p[i] = digest(byte(i + 1))
	}
	p[11] = digest(0x11)
	if stage == attestationv1.Stage_STAGE_READY {
		p[13] = digest(0x13)
	}
	return p
}

func doc(t *testing.T, m map[string]any) *structpb.Struct {
	s, err := structpb.NewStruct(m)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func goldenAll() map[string]any {
	g := map[string]any{}
	for _, i := range []int{0, 2, 3, 4, 6, 7} {
		g[string(rune('0'+i))] = hx(byte(i + 1))
	}
	return g
}

func TestEvaluate(t *testing.T) {
	initrd, ready := attestationv1.Stage_STAGE_INITRD, attestationv1.Stage_STAGE_READY
	full := func(extra map[string]any) map[string]any {
		m := map[string]any{
			"pcr11":  map[string]any{PhaseInitrd: hx(0x11), PhaseReady: hx(0x11)},
			"golden": map[string]any{"sha256": goldenAll()},
		}
		for k, v := range extra {
			m[k] = v
		}
		return m
	}
	withGolden := func(k, v string) map[string]any {
		m := full(nil)
		g := goldenAll()
		g[k] = v
		m["golden"] = map[string]any{"sha256": g}
		return m
	}
	cases := []struct {
		name    string
		doc     map[string]any
		stage   attestationv1.Stage
		kube    string
		learn   bool
		reason  string // substring; empty means verified
		learned []uint32
	}{
		{"verified initrd", full(nil), initrd, "", false, "", nil},
		{"verified ready, pcr 13 unknown is recorded", full(nil), ready, "", false, "", nil},
		{"pcr 0 mismatch, when the policy has one", withGolden("0", hx(0xee)), initrd, "", false, "golden mismatch: pcr 0 expected " + hx(0xee) + ", got " + hx(1), nil},
		{"pcr 11 mismatch", full(map[string]any{"pcr11": map[string]any{PhaseInitrd: hx(0x99), PhaseReady: hx(0x11)}}), initrd, "", false, "pcr 11 mismatch for phase enter-initrd", nil},
		{"pcr 13 for the wrong kubernetes", full(map[string]any{"pcr13": map[string]any{"v1.34.0": hx(0x77)}}), ready, "v1.34.0", false, "pcr 13 expected " + hx(0x77) + ", got " + hx(0x13) + " for kubernetes v1.34.0", nil},
		{"pcr 13 for the right kubernetes", full(map[string]any{"pcr13": map[string]any{"v1.34.0": hx(0x13)}}), ready, "v1.34.0", false, "", nil},
		{"no golden values", map[string]any{"pcr11": map[string]any{PhaseInitrd: hx(0x11), PhaseReady: hx(0x11)}}, initrd, "", false, "no golden value for pcr 2, 3, 4, 6, 7", nil},
		{"no golden values, learn mode", map[string]any{}, initrd, "", true, "", []uint32{2, 3, 4, 6, 7}},
		{"learn mode still compares", withGolden("2", hx(0xee)), initrd, "", true, "golden mismatch: pcr 2", nil},
		{"pcr 9 golden compared when quoted", withGolden("9", hx(0x09)), initrd, "", false, "pcr 9 has a golden value but was not quoted", nil},
		{"pcr 1 and 5 never compared", withGolden("1", hx(0xee)), initrd, "", false, "", nil},
		{"golden pcr 13 is for the ready stage", withGolden("13", hx(0xee)), initrd, "", false, "", nil},
		{"golden pcr 13 at ready without a version", withGolden("13", hx(0xee)), ready, "", false, "golden mismatch: pcr 13 expected", nil},
	}
	type kernelCase struct {
		name, reason string
		doc          map[string]any
		learn        bool
		learned      []uint32
	}
	// A direct-kernel image: PCR 9 is golden at both stages.
	for _, c := range []kernelCase{
		{"direct kernel without golden pcr 9", "no golden value for pcr 9", full(nil), false, nil},
		{"direct kernel, learn mode", "", full(nil), true, []uint32{9}},
		{"direct kernel with golden pcr 9", "", withGolden("9", hx(0x09)), false, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			pcrs := quoted(initrd)
			pcrs[9] = bytes.Repeat([]byte{0x09}, 32)
			out := Evaluate(doc(t, c.doc), initrd, "", true, "", pcrs, nil, c.learn)
			if c.reason == "" && out.Reason != "" || !strings.Contains(out.Reason, c.reason) {
				t.Fatalf("reason %q, want %q", out.Reason, c.reason)
			}
			if len(out.Learned) != len(c.learned) {
				t.Errorf("learned %v, want %v", out.Learned, c.learned)
			}
		})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			out := Evaluate(doc(t, c.doc), c.stage, c.kube, false, "", quoted(c.stage), nil, c.learn)
			if c.reason == "" && out.Reason != "" || !strings.Contains(out.Reason, c.reason) {
				t.Fatalf("reason %q, want %q", out.Reason, c.reason)
			}
			if len(out.Learned) != len(c.learned) {
				t.Errorf("learned %v, want %v", out.Learned, c.learned)
			}
		})
	}
}

// PCR 12 on a first boot holds the host's "ignition.firstboot" (systemd-stub
// 257 measures its SMBIOS command line extra; 252 ignores it): the golden
// value extended by it is accepted on that boot, and only there. A later
// boot with the same PCR 12 (a loader entry passing those options) is
// refused, and so is anything else on a first boot.
func TestEvaluatePCR12CmdlineExtra(t *testing.T) {
	initrd := attestationv1.Stage_STAGE_INITRD
	g := goldenAll()
	g["12"] = hex.EncodeToString(make([]byte, 32))
	d := map[string]any{"pcr11": map[string]any{PhaseInitrd: hx(0x11), PhaseReady: hx(0x11)}, "golden": map[string]any{"sha256": g}}
	firstBoot := quoted(initrd)
	firstBoot[12] = measure.Replay([]measure.Event{measure.CmdlineExtraEvent("ignition.firstboot")})
	later := quoted(initrd)
	later[12] = make([]byte, 32)
	other := quoted(initrd)
	other[12] = measure.Replay([]measure.Event{measure.CmdlineExtraEvent("ignition.firstboot init=/bin/sh")})
	for _, c := range []struct {
		name  string
		extra string
		pcrs  map[uint32][]byte
		ok    bool
	}{
		{"first boot", "ignition.firstboot", firstBoot, true},
		{"later boot", "", later, true},
		{"first boot's PCR 12 on a later boot", "", firstBoot, false},
		{"first boot, a stub that ignores the extra", "ignition.firstboot", later, true},
		{"first boot, something else in PCR 12", "ignition.firstboot", other, false},
	} {
		out := Evaluate(doc(t, d), initrd, "", false, c.extra, c.pcrs, nil, false)
		if (out.Reason == "") != c.ok {
			t.Errorf("%s: reason %q", c.name, out.Reason)
		}
		if !c.ok && !strings.Contains(out.Reason, "pcr 12 expected") {
			t.Errorf("%s: reason %q does not name pcr 12", c.name, out.Reason)
		}
	}
}
