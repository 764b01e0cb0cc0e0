package measure

import (
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Authenticode agrees with osslsigncode's digest of a signed PE: the
// certificate table and its directory entry are left out, the rest counts.
// (The firmware's own digest of a UKI is checked by the boot tests: PCR 4.)
func TestAuthenticodeMatchesOsslsigncode(t *testing.T) {
	const stub = "/usr/lib/systemd/boot/efi/linuxx64.efi.stub"
	for _, tool := range []string{"osslsigncode", "openssl"} {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s missing on CI (make deps installs it)", tool)
			}
			t.Skipf("%s not installed", tool)
		}
	}
	if _, err := os.Stat(stub); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("%s missing on CI (make deps installs systemd-boot-efi)", stub)
		}
		t.Skipf("%s not installed", stub)
	}
	dir := t.TempDir()
	p := func(n string) string { return filepath.Join(dir, n) }
	run := func(name string, args ...string) string {
		t.Helper()
		out, err := exec.Command(name, args...).CombinedOutput()
		if err != nil {
			t.Fatalf("%s %v: %v\n%s", name, args, err, out)
		}
		return string(out)
	}
	run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=vm-manager test", "-days", "1", "-keyout", p("key.pem"), "-out", p("cert.pem"))
	run("osslsigncode", "sign", "-certs", p("cert.pem"), "-key", p("key.pem"), "-in", stub, "-out", p("signed.efi"))
	// verify exits 1 on the untrusted self-signed certificate; the digests are printed first.
	out, _ := exec.Command("osslsigncode", "verify", "-in", p("signed.efi")).CombinedOutput()
	m := regexp.MustCompile(`Calculated message digest\s*:\s*([0-9A-Fa-f]{64})`).FindStringSubmatch(string(out))
	if m == nil {
		t.Fatal("osslsigncode printed no calculated digest")
	}
	signed, err := os.ReadFile(p("signed.efi"))
	if err != nil {
		t.Fatal(err)
	}
	got, err := Authenticode(signed)
	if err != nil {
		t.Fatal(err)
	}
	if hex.EncodeToString(got) != strings.ToLower(m[1]) {
		t.Errorf("Authenticode = %x, osslsigncode says %s", got, m[1])
	}
	// A change anywhere outside the excluded fields changes the digest.
	signed[len(signed)/3] ^= 1
	if other, err := Authenticode(signed); err != nil || hex.EncodeToString(other) == hex.EncodeToString(got) {
		t.Errorf("a flipped byte left the digest %x (%v)", other, err)
	}
	if _, err := Authenticode([]byte("MZ not a PE")); err == nil {
		t.Error("garbage accepted")
	}
}
