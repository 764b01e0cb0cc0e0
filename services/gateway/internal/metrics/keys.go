package metrics

import (
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/prometheus/client_golang/prometheus"
)

// AddKeyStats exports the gateway's token verifier's key cache counters,
// read at scrape time.
func (m *Metrics) AddKeyStats(stats func() identity.KeyStats) {
	counter := func(name, help string, f func(identity.KeyStats) uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help}, func() float64 { return float64(f(stats())) })
	}
	m.reg.MustRegister(
		counter("vm_manager_oidc_jwks_fetches_total", "Requests for the OIDC issuer's JWKS (at first use, when the cached keys expire, for a token naming an unknown key).",
			func(s identity.KeyStats) uint64 { return s.Fetches }),
		counter("vm_manager_oidc_jwks_fetch_errors_total", "JWKS requests that failed.",
			func(s identity.KeyStats) uint64 { return s.FetchErrors }),
		counter("vm_manager_oidc_unknown_key_tokens_total", "Tokens refused because no key of the issuer's JWKS matched their kid.",
			func(s identity.KeyStats) uint64 { return s.UnknownKey }),
		counter("vm_manager_oidc_jwks_fetches_denied_total", "Tokens naming an unknown key refused without a JWKS fetch, one having started less than the minimum interval before.",
			func(s identity.KeyStats) uint64 { return s.FetchesDenied }),
	)
}
