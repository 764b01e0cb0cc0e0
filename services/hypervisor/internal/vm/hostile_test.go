package vm

import (
	"bufio"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
)

// TestIMDSSysupdateTraversal serves the real manager's files through the
// IMDS handler, with request-targets parsed as net/http's server parses
// them: the one file inside <image-dir>/sysupdate/<component>/ is served,
// nothing outside it is, whatever the encoding.
func TestIMDSSysupdateTraversal(t *testing.T) {
	m, _ := newTestManager(t, &verifier{})
	images := m.cfg.ImageDir
	const secret = "top secret"
	for _, p := range []string{
		filepath.Join(images, "secret"),
		filepath.Join(images, "sysupdate", "secret"),
		filepath.Join(filepath.Dir(images), "secret"),
		filepath.Join(images, "sysupdate", "kubernetes", "sub", "secret"),
	} {
		if err := os.WriteFile(p, []byte(secret), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	h := imds.New(m, nil)
	get := func(target string) *httptest.ResponseRecorder {
		raw := "GET " + target + " HTTP/1.1\r\nHost: 169.254.169.254\r\n\r\n"
		r, err := http.ReadRequest(bufio.NewReader(strings.NewReader(raw)))
		if err != nil {
			return nil
		}
		r.RemoteAddr = "10.0.0.2:40000"
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	base := imds.BasePath + "/sysupdate/"
	if w := get(base + "kubernetes/SHA256SUMS"); w == nil || w.Code != 200 || w.Body.String() != "aa  k.raw\n" {
		t.Fatalf("the sysupdate file itself: %v", w)
	}
	for _, target := range []string{
		base + "kubernetes/../secret",
		base + "kubernetes/../../secret",
		base + "kubernetes/%2e%2e/secret",
		base + "kubernetes/..%2Fsecret",
		base + "kubernetes/..%2F..%2Fsecret",
		base + "kubernetes/..%2F..%2F..%2Fsecret",
		base + "%2e%2e/secret",
		base + "..%2F../secret",
		base + "kubernetes/sub%2Fsecret",
		base + "kubernetes/sub",
		base + "kubernetes/sub/secret",
		base + "kubernetes/%2Fetc%2Fpasswd",
		base + "%2Fetc/passwd",
		base + "/etc/passwd",
		base + "kubernetes//etc/passwd",
		base + "kubernetes/..%5Csecret",
		base + "kubernetes/secret%00",
		base + "kubernetes/.",
		base + "kubernetes",
		"http://169.254.169.254" + base + "kubernetes/%2e%2e/%2e%2e/secret",
	} {
		w := get(target)
		if w == nil {
			continue // net/http refuses it before any handler
		}
		if w.Code != http.StatusNotFound || strings.Contains(w.Body.String(), secret) {
			t.Errorf("%s: %d %q, want 404", target, w.Code, w.Body.String())
		}
	}
}
