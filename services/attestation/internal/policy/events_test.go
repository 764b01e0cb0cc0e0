package policy

import (
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
)

var testSections = map[string][]byte{
	".linux": measure.Digest([]byte("vmlinuz")), ".osrel": measure.Digest([]byte("ID=test")),
	".cmdline": measure.Digest([]byte("console=ttyS0")), ".initrd": measure.Digest([]byte("initrd")),
}

// boot is what a UKI boot's logs replay to: systemd-stub's section events
// (firmware log, EV_IPL, the section name as description), then the words.
func boot(sections map[string][]byte, words ...string) []verify.Event {
	var evs []verify.Event
	stub, err := measure.SectionEvents(sections)
	if err != nil {
		panic(err)
	}
	for _, e := range stub {
		evs = append(evs, verify.Event{PCR: 11, Type: "EV_IPL", Description: strings.TrimPrefix(strings.TrimPrefix(e.Description, "uki section name "), "uki section "), Digest: e.Digest})
	}
	for _, w := range words {
		evs = append(evs, verify.Event{PCR: 11, Type: verify.TypeUserspace, Description: fmt.Sprintf("phase %q", w), Digest: measure.Digest([]byte(w))})
	}
	return evs
}

func sysextEvents(line string) []verify.Event {
	return []verify.Event{
		{PCR: 13, Type: verify.TypeUserspace, Description: `os-separator "os-separator"`, Digest: measure.Digest([]byte("os-separator"))},
		{PCR: 13, Type: verify.TypeUserspace, Description: fmt.Sprintf("sysext %q", line), Digest: measure.Digest([]byte(line))},
	}
}

func fold(evs []verify.Event, pcr uint32) []byte {
	v := measure.Zero()
	for _, e := range evs {
		if e.PCR == pcr {
			v = measure.Extend(v, e.Digest)
		}
	}
	return v
}

func with(m map[string][]byte, k string, v []byte) map[string][]byte {
	c := maps.Clone(m)
	if v == nil {
		delete(c, k)
	} else {
		c[k] = v
	}
	return c
}

// ukiPolicy expects testSections: uki.sections and the pcr11 they give.
func ukiPolicy(t *testing.T) map[string]any {
	t.Helper()
	secs, p11 := map[string]any{}, map[string]any{}
	for k, v := range testSections {
		secs[k] = hex.EncodeToString(v)
	}
	for _, phase := range []string{PhaseInitrd, PhaseReady} {
		v, err := measure.PCR11(testSections, phase)
		if err != nil {
			t.Fatal(err)
		}
		p11[phase] = hex.EncodeToString(v)
	}
	return map[string]any{"uki": map[string]any{"sections": secs}, "pcr11": p11, "golden": map[string]any{"sha256": goldenAll()}}
}

func h16(b []byte) string { return hex.EncodeToString(b[:8]) }

func TestPCR11NamesTheFirstDifferingEvent(t *testing.T) {
	initrd, ready := attestationv1.Stage_STAGE_INITRD, attestationv1.Stage_STAGE_READY
	readyWords := measure.PhaseWords(PhaseReady)
	otherCmdline, otherInitrd := measure.Digest([]byte("console=ttyS0 init=/bin/sh")), measure.Digest([]byte("another initrd"))
	cases := []struct {
		name   string
		stage  attestationv1.Stage
		events []verify.Event
		named  string // "" means no naming
		nMis   int
		first  *attestationv1.EventMismatch
	}{
		{name: "changed .cmdline", stage: initrd, events: boot(with(testSections, ".cmdline", otherCmdline), "enter-initrd"),
			named: fmt.Sprintf("uki section .cmdline (expected %s, got %s)", h16(testSections[".cmdline"]), h16(otherCmdline)), nMis: 1,
			first: &attestationv1.EventMismatch{Pcr: 11, Type: "EV_IPL", Description: ".cmdline", Digest: hex.EncodeToString(otherCmdline), ExpectedDigest: hex.EncodeToString(testSections[".cmdline"])}},
		{name: "changed .initrd at ready", stage: ready, events: boot(with(testSections, ".initrd", otherInitrd), readyWords...),
			named: fmt.Sprintf("uki section .initrd (expected %s, got %s)", h16(testSections[".initrd"]), h16(otherInitrd)), nMis: 1,
			first: &attestationv1.EventMismatch{Pcr: 11, Type: "EV_IPL", Description: ".initrd", Digest: hex.EncodeToString(otherInitrd), ExpectedDigest: hex.EncodeToString(testSections[".initrd"])}},
		{name: "a section missing", stage: initrd, events: boot(with(testSections, ".osrel", nil), "enter-initrd"),
			named: fmt.Sprintf("uki section name .osrel (expected %s, got %s: EV_IPL .cmdline)", h16(measure.Digest([]byte(".osrel\x00"))), h16(measure.Digest([]byte(".cmdline\x00")))), nMis: 7},
		{name: "a section more", stage: initrd, events: boot(with(testSections, ".splash", measure.Digest([]byte("logo"))), "enter-initrd"),
			named: fmt.Sprintf(`"enter-initrd" (expected %s, got %s: EV_IPL .splash)`, h16(measure.Digest([]byte("enter-initrd"))), h16(measure.Digest([]byte(".splash\x00")))), nMis: 3},
		{name: "a phase more", stage: initrd, events: boot(testSections, "enter-initrd", "leave-initrd"),
			named: fmt.Sprintf(`unexpected phase "leave-initrd" (%s)`, h16(measure.Digest([]byte("leave-initrd")))), nMis: 1,
			first: &attestationv1.EventMismatch{Pcr: 11, Type: verify.TypeUserspace, Description: `phase "leave-initrd"`, Digest: hex.EncodeToString(measure.Digest([]byte("leave-initrd")))}},
		{name: "ready missing", stage: ready, events: boot(testSections, readyWords[:3]...),
			named: fmt.Sprintf(`"ready" missing (expected %s)`, h16(measure.Digest([]byte("ready")))), nMis: 1,
			first: &attestationv1.EventMismatch{Pcr: 11, Type: verify.TypeUserspace, Description: `"ready"`, ExpectedDigest: hex.EncodeToString(measure.Digest([]byte("ready")))}},
		{name: "another phase", stage: ready, events: boot(testSections, "enter-initrd", "leave-initrd", "shutdown", "ready"),
			named: `phase "shutdown" (expected "sysinit")`, nMis: 1},
		{name: "no logs", stage: initrd, events: nil},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pcrs := quoted(c.stage)
			pcrs[11] = fold(c.events, 11)
			if c.events == nil {
				pcrs[11] = digest(0x11)
			}
			out := Evaluate(doc(t, ukiPolicy(t)), c.stage, "", false, "", pcrs, c.events, false)
			today := fmt.Sprintf("pcr 11 mismatch for phase %s: expected %s, got %x", Phase(c.stage), ukiPolicy(t)["pcr11"].(map[string]any)[Phase(c.stage)], pcrs[11])
			if c.named == "" {
				if out.Reason != today || out.MismatchedEvents != nil {
					t.Fatalf("reason %q with %d events, want %q and none", out.Reason, len(out.MismatchedEvents), today)
				}
				return
			}
			if !strings.HasPrefix(out.Reason, today+"; first differing event: "+c.named) {
				t.Fatalf("reason %q\nwant   %q", out.Reason, today+"; first differing event: "+c.named)
			}
			t.Logf("reason: %s", out.Reason)
			if c.nMis != 0 && len(out.MismatchedEvents) != c.nMis {
				t.Errorf("%d mismatched events, want %d: %v", len(out.MismatchedEvents), c.nMis, out.MismatchedEvents)
			}
			if c.first != nil {
				if g := out.MismatchedEvents[0]; g.GetPcr() != c.first.Pcr || g.GetType() != c.first.Type || g.GetDescription() != c.first.Description ||
					g.GetDigest() != c.first.Digest || g.GetExpectedDigest() != c.first.ExpectedDigest {
					t.Errorf("first mismatch %v, want %v", g, c.first)
				}
			}
		})
	}
}

// sysextPolicy expects kubernetes 1.31.4's sysext with sha256 raw.
func sysextPolicy(raw string) map[string]any {
	return map[string]any{
		"sysext": map[string]any{"1.31.4": raw},
		"pcr13":  map[string]any{"1.31.4": hex.EncodeToString(measure.PCR13(measure.SysextLine(raw, measure.SysextFile("1.31.4"))))},
		"golden": map[string]any{"sha256": goldenAll()},
	}
}

func TestPCR13NamesTheSysext(t *testing.T) {
	ready := attestationv1.Stage_STAGE_READY
	want, fetched := strings.Repeat("ab", 32), strings.Repeat("cd", 32)
	wantLine, fetchedLine := measure.SysextLine(want, "kubernetes_1.31.4.raw"), measure.SysextLine(fetched, "kubernetes_1.31.4.raw")
	lying := sysextEvents(fetchedLine)
	lying[1].Description = fmt.Sprintf("sysext %q (not what the digest measured)", wantLine)
	cases := []struct {
		name   string
		tpm    []verify.Event // what PCR 13 holds
		events []verify.Event // what the logs replay to
		named  string         // "" means no naming
	}{
		{"another sysext", sysextEvents(fetchedLine), sysextEvents(fetchedLine), fmt.Sprintf(`sysext %q (expected %q)`, fetchedLine, wantLine)},
		{"a lying record", sysextEvents(fetchedLine), lying, fmt.Sprintf(`sysext %q (not what the digest measured) (expected %q)`, wantLine, wantLine)},
		{"no sysext measured", nil, []verify.Event{}, fmt.Sprintf(`"os-separator" missing (expected %s)`, h16(measure.Digest([]byte("os-separator"))))},
		{"no logs", sysextEvents(fetchedLine), nil, ""},
		{"logs that do not extend pcr 13 to its value", sysextEvents(fetchedLine), sysextEvents(fetchedLine)[:1], ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			pcrs := quoted(ready)
			pcrs[13] = fold(c.tpm, 13)
			d := sysextPolicy(want)
			out := Evaluate(doc(t, d), ready, "1.31.4", false, "", pcrs, c.events, false)
			today := fmt.Sprintf("golden mismatch: pcr 13 expected %s, got %x for kubernetes 1.31.4", d["pcr13"].(map[string]any)["1.31.4"], pcrs[13])
			if slices.Contains(out.Mismatched, 13) {
				t.Errorf("Mismatched %v: pcr 13's events are the policy's to name", out.Mismatched)
			}
			if c.named == "" {
				if out.Reason != today || out.MismatchedEvents != nil {
					t.Fatalf("reason %q with %v, want %q and no events", out.Reason, out.MismatchedEvents, today)
				}
				return
			}
			if out.Reason != today+"; first differing event: "+c.named {
				t.Fatalf("reason %q\nwant   %q", out.Reason, today+"; first differing event: "+c.named)
			}
			t.Logf("reason: %s", out.Reason)
			if len(out.MismatchedEvents) == 0 || out.MismatchedEvents[0].GetPcr() != 13 {
				t.Errorf("mismatched events %v", out.MismatchedEvents)
			}
		})
	}

	// pcr13 without sysext: nothing to name from, the stored golden boot
	// names PCR 13's events as before.
	d := sysextPolicy(want)
	delete(d, "sysext")
	pcrs := quoted(ready)
	out := Evaluate(doc(t, d), ready, "1.31.4", false, "", pcrs, sysextEvents(fetchedLine), false)
	if strings.Contains(out.Reason, "first differing event") || !slices.Contains(out.Mismatched, 13) || out.MismatchedEvents != nil {
		t.Errorf("without sysext: %+v", out)
	}
}

// Logs that replay, but not to the quoted PCR 11: nothing is named.
func TestPCR11NoNamingFromEventsThatDoNotReplay(t *testing.T) {
	initrd := attestationv1.Stage_STAGE_INITRD
	evs := boot(with(testSections, ".cmdline", digest(9)), "enter-initrd")
	pcrs := quoted(initrd)
	pcrs[11] = fold(evs, 11)
	for name, evs := range map[string][]verify.Event{
		"an event short":              evs[:len(evs)-1],
		"no pcr 11 events":            {},
		"another pcr's events":        slices.Concat(evs[:len(evs)-1], []verify.Event{{PCR: 13, Digest: evs[len(evs)-1].Digest}}),
		"an event more":               append(slices.Clone(evs), evs[0]),
		"policy without uki.sections": nil,
	} {
		t.Run(name, func(t *testing.T) {
			d := ukiPolicy(t)
			if evs == nil {
				evs = boot(with(testSections, ".cmdline", digest(9)), "enter-initrd")
				delete(d, "uki")
			}
			out := Evaluate(doc(t, d), initrd, "", false, "", pcrs, evs, false)
			if !strings.HasPrefix(out.Reason, "pcr 11 mismatch for phase enter-initrd") || strings.Contains(out.Reason, "first differing") || out.MismatchedEvents != nil {
				t.Errorf("reason %q, events %v", out.Reason, out.MismatchedEvents)
			}
		})
	}
}
