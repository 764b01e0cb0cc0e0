package identity_test

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/identity/oidctest"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	jose "github.com/go-jose/go-jose/v4"
)

// verifyReason is "" for an accepted token, else the refusal's message.
func verifyReason(v *identity.Verifier, tok string) string {
	_, err := v.Verify(context.Background(), tok)
	if err == nil {
		return ""
	}
	return apierr.MessageOf(err)
}

// TestRetiredKeyExpires: a key the provider removed from its JWKS stops
// verifying once the cached JWKS expires: at the refresh interval, or at the
// provider's shorter cache lifetime. Only tokens of the cached kid are sent,
// so no unknown kid forces the fetch.
func TestRetiredKeyExpires(t *testing.T) {
	cases := []struct {
		name    string
		refresh time.Duration
		header  func() (string, string) // a JWKS answer header, set before the first fetch
	}{
		{"the refresh interval", time.Second, nil},
		{"Cache-Control max-age", time.Hour, func() (string, string) { return "Cache-Control", "public, max-age=1" }},
		{"Expires", time.Hour, func() (string, string) {
			return "Expires", time.Now().Add(2 * time.Second).UTC().Format(http.TimeFormat)
		}},
		{"a max-age beyond the refresh interval", time.Second, func() (string, string) { return "Cache-Control", "max-age=31536000" }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := oidctest.Start(t)
			if tc.header != nil {
				p.SetJWKSHeader(tc.header())
			}
			v := newVerifierConfig(t, identity.Config{Issuer: p.Issuer(), Audiences: []string{p.Audience}, JWKSRefreshInterval: tc.refresh, JWKSMinFetchInterval: 100 * time.Millisecond})
			old := p.SigningKey()
			tok := p.Token(oidctest.Claims{})
			if r := verifyReason(v, tok); r != "" {
				t.Fatalf("a published key's token: %s", r)
			}
			p.RemoveKey(old.ID)
			retired := time.Now()
			if r := verifyReason(v, tok); r != "" && time.Since(retired) < 500*time.Millisecond {
				t.Fatalf("retired key's token at once: %q, want accepted from the cache", r)
			}
			deadline := time.Now().Add(5 * time.Second)
			for verifyReason(v, tok) == "" {
				if time.Now().After(deadline) {
					t.Fatalf("the retired key still verifies 5 s after its retirement (JWKS fetched %d times)", p.JWKSFetches())
				}
				time.Sleep(50 * time.Millisecond)
			}
			if r := verifyReason(v, tok); r != "token signature invalid" {
				t.Errorf("retired key's token: %q, want token signature invalid", r)
			}
			t.Logf("refused %s after the retirement; JWKS fetched %d times", time.Since(retired).Round(10*time.Millisecond), p.JWKSFetches())
			if st := v.KeyStats(); st.Fetches < 2 || st.UnknownKey == 0 {
				t.Errorf("stats %+v: want a refresh and an unknown-key refusal counted", st)
			}
		})
	}
}

// TestNoStoreIsRateLimited: a provider that forbids caching does not make
// the verifier fetch per token: the lifetime has the minimum fetch interval
// as its floor.
func TestNoStoreIsRateLimited(t *testing.T) {
	p := oidctest.Start(t)
	p.SetJWKSHeader("Cache-Control", "no-store")
	const minFetch = 300 * time.Millisecond
	v := newVerifierConfig(t, identity.Config{Issuer: p.Issuer(), Audiences: []string{p.Audience}, JWKSMinFetchInterval: minFetch})
	tok := p.Token(oidctest.Claims{})
	start := time.Now()
	n := 0
	for time.Since(start) < time.Second {
		if r := verifyReason(v, tok); r != "" {
			t.Fatalf("token %d: %s", n, r)
		}
		n++
	}
	elapsed := time.Since(start)
	fetches := p.JWKSFetches()
	t.Logf("%d verifications in %s: %d JWKS fetches", n, elapsed.Round(time.Millisecond), fetches)
	if most := 1 + int(elapsed/minFetch); fetches > most || fetches < 2 {
		t.Errorf("%d verifications in %s fetched the no-store JWKS %d times, want 2..%d", n, elapsed, fetches, most)
	}
}

// TestUnknownKidFlood: hundreds of concurrent tokens, each naming a made-up
// kid (issuer, audience and expiry right, as anyone can write them), make
// one JWKS fetch, shared with the good tokens that arrive meanwhile; after
// it they are refused from the cache, until the minimum fetch interval has
// passed, when again one fetch serves them all.
func TestUnknownKidFlood(t *testing.T) {
	p := oidctest.Start(t)
	p.SetJWKSDelay(200 * time.Millisecond) // the flood arrives while the fetch runs
	const minFetch = 2 * time.Second
	v := newVerifierConfig(t, identity.Config{Issuer: p.Issuer(), Audiences: []string{p.Audience}, JWKSMinFetchInterval: minFetch})
	mallory, err := oidctest.NewKey(jose.ES256)
	if err != nil {
		t.Fatal(err)
	}
	const floodSize = 300
	made := make([]string, floodSize)
	for i := range made {
		k := *mallory
		k.ID = fmt.Sprintf("made-up-%d", i)
		made[i] = p.TokenWith(&k, oidctest.Claims{})
	}
	good := p.Token(oidctest.Claims{})

	flood := func(round string) {
		t.Helper()
		var wg sync.WaitGroup
		errs := make(chan string, floodSize+10)
		for _, tok := range made {
			wg.Go(func() {
				if r := verifyReason(v, tok); r != "token signature invalid" {
					errs <- fmt.Sprintf("made-up kid: %q", r)
				}
			})
		}
		for range 10 {
			wg.Go(func() {
				if r := verifyReason(v, good); r != "" {
					errs <- fmt.Sprintf("good token: %q", r)
				}
			})
		}
		wg.Wait()
		close(errs)
		for e := range errs {
			t.Errorf("%s: %s", round, e)
		}
	}

	flood("first flood, nothing cached")
	t.Logf("first flood: %d JWKS fetches, %+v", p.JWKSFetches(), v.KeyStats())
	if n := p.JWKSFetches(); n != 1 {
		t.Errorf("first flood: %d JWKS fetches, want 1 shared by all", n)
	}
	flood("second flood")
	t.Logf("second flood: %d JWKS fetches, %+v", p.JWKSFetches(), v.KeyStats())
	if n := p.JWKSFetches(); n != 1 {
		t.Errorf("second flood, within the minimum interval: %d JWKS fetches, want still 1", n)
	}
	st := v.KeyStats()
	if st.Fetches != 1 || st.UnknownKey != 2*floodSize || st.FetchesDenied < floodSize {
		t.Errorf("stats %+v: want 1 fetch, %d unknown-key refusals, at least %d of them without a fetch", st, 2*floodSize, floodSize)
	}

	time.Sleep(minFetch)
	start := time.Now()
	flood("after the interval")
	elapsed := time.Since(start)
	t.Logf("after the interval: %d JWKS fetches in all, %+v", p.JWKSFetches(), v.KeyStats())
	if n, most := p.JWKSFetches(), 2+int(elapsed/minFetch); n < 2 || n > most {
		t.Errorf("flood after the interval (%s): %d JWKS fetches in all, want 2..%d", elapsed, n, most)
	}
}

// TestFetchFailure: a JWKS that cannot be fetched refuses tokens with
// "token signing keys unavailable" once the cache has expired, and is asked
// again only after the minimum fetch interval; when it answers again, tokens
// verify.
func TestFetchFailure(t *testing.T) {
	p := oidctest.Start(t)
	const minFetch = time.Second // the refresh interval's
	v := newVerifierConfig(t, identity.Config{Issuer: p.Issuer(), Audiences: []string{p.Audience}, JWKSRefreshInterval: time.Second})
	tok := p.Token(oidctest.Claims{})
	if r := verifyReason(v, tok); r != "" {
		t.Fatal(r)
	}
	p.SetJWKSStatus(http.StatusServiceUnavailable)
	deadline := time.Now().Add(5 * time.Second)
	for verifyReason(v, tok) == "" {
		if time.Now().After(deadline) {
			t.Fatal("the cached keys never expired")
		}
		time.Sleep(50 * time.Millisecond)
	}
	failedAt := time.Now()
	fetches := p.JWKSFetches()
	for range 50 {
		if r := verifyReason(v, tok); r != "token signing keys unavailable" {
			t.Fatalf("with the JWKS failing: %q", r)
		}
	}
	// The failed fetch started at most a poll (50 ms) and its answer
	// before failedAt: half the interval leaves room.
	if n := p.JWKSFetches(); time.Since(failedAt) < minFetch/2 && n != fetches {
		t.Errorf("50 tokens right after a failed fetch fetched %d more times, want none", n-fetches)
	}
	if st := v.KeyStats(); st.FetchErrors == 0 {
		t.Errorf("stats %+v: the failed fetch is not counted", st)
	}
	p.SetJWKSStatus(0)
	deadline = time.Now().Add(5 * time.Second)
	for verifyReason(v, tok) != "" {
		if time.Now().After(deadline) {
			t.Fatal("tokens still refused 5 s after the JWKS answers again")
		}
		time.Sleep(50 * time.Millisecond)
	}
}
