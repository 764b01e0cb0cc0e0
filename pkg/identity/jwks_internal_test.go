package identity

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"
)

func TestCacheLifetime(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	date := now.Add(-time.Hour).Format(http.TimeFormat) // a provider whose clock is an hour behind
	cases := []struct {
		name   string
		header http.Header
		want   time.Duration
		ok     bool
	}{
		{"none", http.Header{}, 0, false},
		{"max-age", http.Header{"Cache-Control": {"public, max-age=600, must-revalidate"}}, 10 * time.Minute, true},
		{"MAX-AGE quoted", http.Header{"Cache-Control": {`Max-Age="60"`}}, time.Minute, true},
		{"max-age beats Expires", http.Header{"Cache-Control": {"max-age=5"}, "Expires": {now.Add(time.Hour).Format(http.TimeFormat)}}, 5 * time.Second, true},
		{"max-age over a year", http.Header{"Cache-Control": {"max-age=999999999999999999"}}, 365 * 24 * time.Hour, true},
		{"max-age invalid", http.Header{"Cache-Control": {"max-age=soon"}}, 0, true},
		{"max-age negative", http.Header{"Cache-Control": {"max-age=-1"}}, 0, true},
		{"no-store", http.Header{"Cache-Control": {"no-store"}}, 0, true},
		{"no-cache before max-age", http.Header{"Cache-Control": {"no-cache, max-age=600"}}, 0, true},
		{"second header line", http.Header{"Cache-Control": {"public", "max-age=7"}}, 7 * time.Second, true},
		{"Expires against now", http.Header{"Expires": {now.Add(90 * time.Second).Format(http.TimeFormat)}}, 90 * time.Second, true},
		{"Expires against Date", http.Header{"Expires": {now.Add(-time.Hour + 30*time.Second).Format(http.TimeFormat)}, "Date": {date}}, 30 * time.Second, true},
		{"Expires past", http.Header{"Expires": {now.Add(-time.Minute).Format(http.TimeFormat)}}, 0, true},
		{"Expires 0", http.Header{"Expires": {"0"}}, 0, true},
	}
	for _, tc := range cases {
		got, ok := cacheLifetime(tc.header, now)
		if got != tc.want || ok != tc.ok {
			t.Errorf("%s: %s, %t; want %s, %t", tc.name, got, ok, tc.want, tc.ok)
		}
	}
	s := &keySet{refresh: 5 * time.Minute, minFetch: 10 * time.Second, now: func() time.Time { return now }}
	for _, tc := range []struct {
		cc   string
		want time.Duration
	}{
		{"", 5 * time.Minute},
		{"max-age=0", 10 * time.Second},
		{"max-age=60", time.Minute},
		{"max-age=86400", 5 * time.Minute},
	} {
		h := http.Header{}
		if tc.cc != "" {
			h.Set("Cache-Control", tc.cc)
		}
		if got := s.lifetime(h); got != tc.want {
			t.Errorf("lifetime with Cache-Control %q = %s, want %s", tc.cc, got, tc.want)
		}
	}
}

func TestConfigIntervals(t *testing.T) {
	for _, tc := range []struct {
		cfg               Config
		refresh, minFetch time.Duration
		err               string
	}{
		{Config{}, DefaultJWKSRefreshInterval, DefaultJWKSMinFetchInterval, ""},
		{Config{JWKSRefreshInterval: 2 * time.Second}, 2 * time.Second, 2 * time.Second, ""},
		{Config{JWKSRefreshInterval: time.Hour, JWKSMinFetchInterval: time.Millisecond}, time.Hour, time.Millisecond, ""},
		{Config{JWKSRefreshInterval: time.Millisecond}, 0, 0, "at least 1s"},
		{Config{JWKSRefreshInterval: -time.Second}, 0, 0, "at least 1s"},
		{Config{JWKSMinFetchInterval: -time.Second}, 0, 0, "negative"},
	} {
		r, m, err := tc.cfg.jwksIntervals()
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("%+v: err %v, want %q", tc.cfg, err, tc.err)
			}
			continue
		}
		if err != nil || r != tc.refresh || m != tc.minFetch {
			t.Errorf("%+v: %s, %s, %v; want %s, %s", tc.cfg, r, m, err, tc.refresh, tc.minFetch)
		}
	}
}

// TestJWKSAnswers: what the provider answers is bounded and filtered.
func TestJWKSAnswers(t *testing.T) {
	priv, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	good, _ := json.Marshal(jose.JSONWebKey{Key: &priv.PublicKey, KeyID: "good", Algorithm: "ES256", Use: "sig"})
	private, _ := json.Marshal(jose.JSONWebKey{Key: priv, KeyID: "private", Algorithm: "ES256", Use: "sig"})
	var body string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte(body)) }))
	defer srv.Close()
	s := &keySet{hc: srv.Client(), url: srv.URL, refresh: time.Minute, minFetch: time.Second, now: time.Now, log: slog.New(slog.DiscardHandler)}

	body = `{"keys":[` + string(good) + `,{"kty":"XYZ","kid":"future"},` + string(private) + `,{"kty":"oct","kid":"hmac","k":"c2VjcmV0"}]}`
	keys, _, err := s.get(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, k := range keys {
		if !k.IsPublic() {
			t.Errorf("key %s kept with private parts", k.KeyID)
		}
		ids = append(ids, k.KeyID)
	}
	// The unknown type and the symmetric key are skipped, the private key
	// kept as its public part.
	if strings.Join(ids, ",") != "good,private" {
		t.Errorf("keys %v, want good,private", ids)
	}

	body = `{"keys":[` + strings.Repeat(string(good)+",", maxJWKSBytes/len(good)) + string(good) + `]}`
	if _, _, err := s.get(context.Background()); err == nil || !strings.Contains(err.Error(), "larger than") {
		t.Errorf("a JWKS over %d bytes: err %v", maxJWKSBytes, err)
	}
	body = `<html>`
	if _, _, err := s.get(context.Background()); err == nil || !strings.Contains(err.Error(), "not a JWKS") {
		t.Errorf("HTML: err %v", err)
	}
}
