package server

import (
	"context"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// The TLS pair goes together and must load; without either the gateway
// serves plaintext.
func TestLoadTLS(t *testing.T) {
	if cfg, err := loadTLS("", ""); cfg != nil || err != nil {
		t.Errorf("no pair: %v %v", cfg, err)
	}
	if _, err := loadTLS("cert.pem", ""); err == nil || !strings.Contains(err.Error(), "go together") {
		t.Errorf("a cert without a key: %v", err)
	}
	bad := filepath.Join(t.TempDir(), "bad.pem")
	if err := os.WriteFile(bad, []byte("not pem"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := loadTLS(bad, bad); err == nil || !strings.Contains(err.Error(), "TLS certificate") {
		t.Errorf("a bad pair: %v", err)
	}
}

// A readiness check (a fleet gateway's) answers /readyz: 503 with its
// reason, or 200.
func TestReadyzFunc(t *testing.T) {
	for _, tc := range []struct {
		err  error
		code int
		body string
	}{
		{nil, 200, "ok"},
		{apierr.Errorf(apierr.Unavailable, "no fleet node ready: node node-1 did not answer"), 503, "not ready: no fleet node ready: node node-1 did not answer\n"},
	} {
		rec := httptest.NewRecorder()
		readyzFunc(func(context.Context) error { return tc.err })(rec, httptest.NewRequest("GET", "/readyz", nil))
		if rec.Code != tc.code || rec.Body.String() != tc.body {
			t.Errorf("readyz with %v: %d %q", tc.err, rec.Code, rec.Body.String())
		}
	}
}
