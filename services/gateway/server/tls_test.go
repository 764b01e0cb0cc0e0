package server

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
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
