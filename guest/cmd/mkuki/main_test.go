package main

import (
	"bytes"
	"debug/pe"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/pkg/measure"
)

const (
	stub           = "/usr/lib/systemd/boot/efi/linuxx64.efi.stub"
	systemdMeasure = "/usr/lib/systemd/systemd-measure"
)

func need(t *testing.T, path string) {
	t.Helper()
	if _, err := os.Stat(path); err == nil {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s missing on CI (make deps installs it)", path)
	}
	t.Skipf("%s not installed (make deps)", path)
}

func inputs(t *testing.T, dir string) config {
	t.Helper()
	// A PE stands in for the kernel (a bzImage is one, with its EFI stub):
	// the policy records its Authenticode hash.
	kernel, err := os.ReadFile(stub)
	if err != nil {
		t.Fatal(err)
	}
	files := map[string][]byte{
		"linux":   kernel,
		"initrd":  bytes.Repeat([]byte{7, 0, 1}, 3000),
		"cmdline": []byte("console=ttyS0 panic=-1"),
		"osrel":   []byte("ID=test\nVERSION_ID=1\n"),
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	p := func(n string) string { return filepath.Join(dir, n) }
	return config{
		stub:     stub,
		sections: []section{{".linux", p("linux")}, {".osrel", p("osrel")}, {".cmdline", p("cmdline")}, {".initrd", p("initrd")}},
		imageID:  "test", imageVersion: "1",
	}
}

// The UKI is byte-reproducible, carries each input as its section, and the
// policy's PCR 11 is what systemd-measure predicts for the same inputs.
func TestBuild(t *testing.T) {
	need(t, stub)
	dir := t.TempDir()
	c := inputs(t, dir)
	var built [][]byte
	for i, out := range []string{"a.efi", "b.efi"} {
		c.out, c.policy = filepath.Join(dir, out), filepath.Join(dir, out+".policy.json")
		if err := run(c); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(c.out)
		if err != nil {
			t.Fatal(err)
		}
		built = append(built, b)
		if i == 0 {
			continue
		}
		if !bytes.Equal(built[0], built[1]) {
			t.Fatal("two builds of the same inputs differ")
		}
	}
	peOff := binary.LittleEndian.Uint32(built[0][0x3c:])
	if ts := binary.LittleEndian.Uint32(built[0][peOff+8:]); ts != 0 {
		t.Errorf("PE timestamp %d, want 0", ts)
	}

	f, err := pe.Open(c.out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, s := range c.sections {
		want, _ := os.ReadFile(s.file)
		sec := f.Section(s.name)
		if sec == nil {
			t.Fatalf("no %s section", s.name)
		}
		got, _ := sec.Data()
		if int(sec.VirtualSize) != len(want) || !bytes.Equal(got[:len(want)], want) {
			t.Errorf("section %s: %d bytes, not the input's %d", s.name, sec.VirtualSize, len(want))
		}
	}

	var doc struct {
		ImageID string            `json:"image_id"`
		PCR11   map[string]string `json:"pcr11"`
		UKI     struct {
			Sections     map[string]string `json:"sections"`
			Authenticode map[string]string `json:"authenticode"`
		} `json:"uki"`
	}
	b, _ := os.ReadFile(c.policy)
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	if doc.ImageID != "test" || len(doc.UKI.Sections) != 4 {
		t.Errorf("policy %s", b)
	}
	for key, file := range map[string]string{"uki": c.out, "linux": c.sections[0].file} {
		pe, _ := os.ReadFile(file)
		want, err := measure.Authenticode(pe)
		if err != nil || doc.UKI.Authenticode[key] != hex.EncodeToString(want) {
			t.Errorf("authenticode %s = %s, want %x (%v)", key, doc.UKI.Authenticode[key], want, err)
		}
	}
	need(t, systemdMeasure)
	args := []string{"calculate", "--bank=sha256"}
	for _, s := range c.sections {
		args = append(args, "--"+strings.TrimPrefix(s.name, ".")+"="+s.file)
	}
	for _, phase := range []string{measure.PhaseInitrd, measure.PhaseReady} {
		out, err := exec.Command(systemdMeasure, append(args, "--phase="+phase)...).Output()
		if err != nil {
			t.Fatal(err)
		}
		m := regexp.MustCompile(`11:sha256=([0-9a-f]{64})`).FindSubmatch(out)
		if m == nil || doc.PCR11[phase] != string(m[1]) {
			t.Errorf("phase %s: policy says %s, systemd-measure %s", phase, doc.PCR11[phase], out)
		}
	}
}

func TestBuildRefusesEmptySection(t *testing.T) {
	need(t, stub)
	dir := t.TempDir()
	c := inputs(t, dir)
	c.out = filepath.Join(dir, "x.efi")
	if err := os.WriteFile(c.sections[2].file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := run(c); err == nil || !strings.Contains(err.Error(), ".cmdline") {
		t.Errorf("empty .cmdline: %v", err)
	}
	if _, err := os.Stat(c.out); err == nil {
		t.Error("a UKI was written")
	}
}

func TestKubernetes(t *testing.T) {
	dir := t.TempDir()
	sum := strings.Repeat("ab", 32)
	write := func(s string) string {
		p := filepath.Join(dir, "SHA256SUMS")
		if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	sysext, pcr13, err := kubernetes(write(sum + "  kubernetes_1.34.2.raw\n" + strings.ToUpper(sum) + " *kubernetes_1.33.6.raw\n" + sum + "  base_1.raw\n\n"))
	if err != nil {
		t.Fatal(err)
	}
	if len(sysext) != 2 || sysext["1.33.6"] != sum {
		t.Errorf("sysext %v", sysext)
	}
	want := measure.PCR13(measure.SysextLine(sum, "kubernetes_1.34.2.raw"))
	if pcr13["1.34.2"] != hex.EncodeToString(want) {
		t.Errorf("pcr13 %v, want %x", pcr13, want)
	}
	for _, bad := range []string{"nothex  kubernetes_1.raw\n", sum + "\n", sum + "  kubernetes_1.raw\n" + sum + "  kubernetes_1.raw\n"} {
		if _, _, err := kubernetes(write(bad)); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
