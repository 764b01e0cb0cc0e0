package vm

import "testing"

// A guest's request names its span only through the key table.
func TestIMDSRoute(t *testing.T) {
	for path, want := range map[string]string{
		"/giantswarm/v1/attest/nonce":                    "/giantswarm/v1/attest/nonce",
		"/giantswarm/v1/metadata/role":                   "/giantswarm/v1/metadata/{key}",
		"/giantswarm/v1/public-keys/":                    "/giantswarm/v1/public-keys/{$}",
		"/giantswarm/v1/public-keys/0":                   "/giantswarm/v1/public-keys/{index}",
		"/giantswarm/v1/sysupdate/kubernetes/SHA256SUMS": "/giantswarm/v1/sysupdate/{component}/{file}",
		"/giantswarm/v1/metadata/":                       "{unmatched}",
		"/giantswarm/v1/made-up-1234":                    "{unmatched}",
		"/giantswarm/v1/sysupdate/a/b/c":                 "{unmatched}",
		"/latest/meta-data/":                             "{unmatched}",
		"":                                               "{unmatched}",
	} {
		if got := imdsRoute(path); got != want {
			t.Errorf("imdsRoute(%q) = %q, want %q", path, got, want)
		}
	}
}
