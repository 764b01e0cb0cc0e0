package measure

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

const systemdMeasure = "/usr/lib/systemd/systemd-measure"

// TestPCR11MatchesSystemdMeasure computes PCR 11 for the same sections and
// phase paths as systemd-measure calculate, and must agree byte for byte.
func TestPCR11MatchesSystemdMeasure(t *testing.T) {
	if _, err := os.Stat(systemdMeasure); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s missing on CI (make deps installs systemd): %v", systemdMeasure, err)
		}
		t.Skipf("%s not installed: %v", systemdMeasure, err)
	}
	dir := t.TempDir()
	contents := map[string][]byte{
		".linux":   bytes.Repeat([]byte("kernel"), 10000),
		".osrel":   []byte("ID=test-guest\nVERSION_ID=0.1.0\n"),
		".cmdline": []byte("console=ttyS0 panic=-1"),
		".initrd":  bytes.Repeat([]byte{0, 1, 2, 3}, 5000),
	}
	args := []string{"calculate", "--bank=sha256"}
	digests := map[string][]byte{}
	for name, b := range contents {
		p := filepath.Join(dir, name[1:])
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
		args = append(args, "--"+name[1:]+"="+p)
		digests[name] = Digest(b)
	}
	for _, phase := range []string{"", PhaseInitrd, WordEnterInitrd + ":" + WordLeaveInitrd, PhaseReady} {
		out, err := exec.Command(systemdMeasure, append(args, "--phase="+phase)...).Output()
		if err != nil {
			t.Fatalf("systemd-measure --phase=%q: %v", phase, err)
		}
		m := regexp.MustCompile(`11:sha256=([0-9a-f]{64})`).FindSubmatch(out)
		if m == nil {
			t.Fatalf("systemd-measure printed no sha256 PCR 11: %s", out)
		}
		got, err := PCR11(digests, phase)
		if err != nil {
			t.Fatal(err)
		}
		if hex.EncodeToString(got) != string(m[1]) {
			t.Errorf("phase %q: PCR11 = %x, systemd-measure says %s", phase, got, m[1])
		}
	}

	// Without .initrd the stub measures one section less.
	delete(digests, ".initrd")
	var noInitrd []string
	for _, a := range args {
		if !strings.HasPrefix(a, "--initrd=") {
			noInitrd = append(noInitrd, a)
		}
	}
	out, err := exec.Command(systemdMeasure, append(noInitrd, "--phase=")...).Output()
	if err != nil {
		t.Fatal(err)
	}
	got, _ := PCR11(digests, "")
	if !bytes.Contains(out, []byte(hex.EncodeToString(got))) {
		t.Errorf("without .initrd: PCR11 = %x, systemd-measure says %s", got, out)
	}
}

func TestSectionEventsRefusesUnmeasuredSections(t *testing.T) {
	for _, name := range []string{".pcrsig", ".text", ".reloc"} {
		if _, err := SectionEvents(map[string][]byte{name: Digest(nil)}); err == nil {
			t.Errorf("%s accepted: systemd-stub does not measure it", name)
		}
	}
	if _, err := SectionEvents(map[string][]byte{".linux": {1, 2}}); err == nil {
		t.Error("a 2-byte digest accepted")
	}
}

// TestPCR13Rule: zero, extended with sha256("os-separator"), then with
// sha256 of the SHA256SUMS line.
func TestPCR13Rule(t *testing.T) {
	line := SysextLine(strings.Repeat("AB", 32), SysextFile("1.31.0"))
	if line != strings.Repeat("ab", 32)+"  kubernetes_1.31.0.raw" {
		t.Fatalf("line = %q", line)
	}
	want := Extend(Extend(Zero(), Digest([]byte("os-separator"))), Digest([]byte(line)))
	if got := PCR13(line); !bytes.Equal(got, want) {
		t.Errorf("PCR13 = %x, want %x", got, want)
	}
}

func TestLogRoundTrip(t *testing.T) {
	var buf bytes.Buffer
	for _, w := range PhaseWords(PhaseReady) {
		if err := WriteRecord(&buf, WordRecord(PCRKernelImage, w, EventTypePhase, "b00t", 42)); err != nil {
			t.Fatal(err)
		}
	}
	if err := WriteRecord(&buf, WordRecord(PCRSysext, WordOSSeparator, EventTypeOSSeparator, "", 0)); err != nil {
		t.Fatal(err)
	}
	if buf.Bytes()[0] != 0x1e {
		t.Fatalf("no RS before the first record: %q", buf.String())
	}
	evs, err := ParseLog(buf.Bytes())
	if err != nil {
		t.Fatal(err)
	}
	if len(evs) != 5 {
		t.Fatalf("%d events, want 5", len(evs))
	}
	var p11 []Event
	for _, e := range evs {
		if e.PCR == PCRKernelImage {
			p11 = append(p11, e)
		}
	}
	want := Zero()
	for _, w := range PhaseWords(PhaseReady) {
		want = Extend(want, Digest([]byte(w)))
	}
	if got := Replay(p11); !bytes.Equal(got, want) {
		t.Errorf("replay = %x, want %x", got, want)
	}
	if evs[0].Description != `phase "enter-initrd"` {
		t.Errorf("description = %q", evs[0].Description)
	}

	// A record whose word is not what its digest measured says so.
	r := WordRecord(PCRSysext, "a  kubernetes_1.31.4.raw", EventTypeSysext, "", 0)
	r.Content.String = "b  kubernetes_1.31.4.raw"
	buf.Reset()
	if err := WriteRecord(&buf, r); err != nil {
		t.Fatal(err)
	}
	evs, err = ParseLog(buf.Bytes())
	if err != nil || len(evs) != 1 || evs[0].Description != `sysext "b  kubernetes_1.31.4.raw" (not what the digest measured)` {
		t.Errorf("lying record = %+v, %v", evs, err)
	}
}

func TestParseLogRejectsWhatCannotBeReplayed(t *testing.T) {
	for name, in := range map[string]string{
		"not json":   "\x1e{nope\n",
		"no sha256":  "\x1e{\"pcr\":11,\"digests\":[{\"hashAlg\":\"sha1\",\"digest\":\"00\"}]}\n",
		"short hash": "\x1e{\"pcr\":11,\"digests\":[{\"hashAlg\":\"sha256\",\"digest\":\"00\"}]}\n",
	} {
		if _, err := ParseLog([]byte(in)); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	var buf bytes.Buffer
	for range MaxLogRecords + 1 {
		_ = WriteRecord(&buf, WordRecord(PCRKernelImage, "x", EventTypePhase, "", 0))
	}
	if _, err := ParseLog(buf.Bytes()); err == nil {
		t.Errorf("%d records accepted", MaxLogRecords+1)
	}
}

// TestCmdlineExtraEvent: "ignition.firstboot" as UTF-16LE with its NUL, the
// bytes systemd-stub 257 measures into PCR 12 (the value a first boot of
// vm-base reads from its vTPM, tests/vmbase_test.go).
func TestCmdlineExtraEvent(t *testing.T) {
	e := CmdlineExtraEvent("ignition.firstboot")
	want := sha256.Sum256([]byte("i\x00g\x00n\x00i\x00t\x00i\x00o\x00n\x00.\x00f\x00i\x00r\x00s\x00t\x00b\x00o\x00o\x00t\x00\x00\x00"))
	if e.PCR != PCRParameters || !bytes.Equal(e.Digest, want[:]) {
		t.Errorf("event %+v, want digest %x", e, want)
	}
	if got := hex.EncodeToString(Replay([]Event{e})); got != "10c95b64dd7a6fc66132b8340dda72c0dae946ea9f640c23b86dfbddfefc829e" {
		t.Errorf("PCR 12 %s", got)
	}
}
