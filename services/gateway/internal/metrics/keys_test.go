package metrics

import (
	"testing"

	"github.com/giantswarm/vm-manager/pkg/identity"
)

func TestKeyStats(t *testing.T) {
	m := New(nil, nil)
	if f := scrape(t, m); f["vm_manager_oidc_jwks_fetches_total"] != nil {
		t.Error("JWKS counters without a verifier")
	}
	stats := identity.KeyStats{Fetches: 3, FetchErrors: 1, UnknownKey: 200, FetchesDenied: 199}
	m.AddKeyStats(func() identity.KeyStats { return stats })
	f := scrape(t, m)
	f.want(t, 3, "vm_manager_oidc_jwks_fetches_total")
	f.want(t, 1, "vm_manager_oidc_jwks_fetch_errors_total")
	f.want(t, 200, "vm_manager_oidc_unknown_key_tokens_total")
	f.want(t, 199, "vm_manager_oidc_jwks_fetches_denied_total")
}
