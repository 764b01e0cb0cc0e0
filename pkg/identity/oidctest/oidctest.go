// Package oidctest is an OpenID Provider for tests: an HTTP server serving
// the discovery document and a JWKS, minting id_tokens signed with RS256 or
// ES256 keys whose claims a test chooses, with key rotation, and the
// authorization code flow with PKCE for clients that log in by themselves.
// It is a real issuer over HTTP, not a mock: verifiers discover it and fetch
// its keys, and clients get their tokens from it, as from any other.
package oidctest

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	jose "github.com/go-jose/go-jose/v4"
)

// Key is a signing key. Keys made with NewKey are not published in any JWKS
// until a Provider adds them.
type Key struct {
	ID        string
	Algorithm jose.SignatureAlgorithm
	private   crypto.Signer
}

var keySeq atomic.Uint64

// NewKey generates a key for RS256 (2048-bit RSA) or ES256 (P-256).
func NewKey(alg jose.SignatureAlgorithm) (*Key, error) {
	var (
		priv crypto.Signer
		err  error
	)
	switch alg {
	case jose.RS256:
		priv, err = rsa.GenerateKey(rand.Reader, 2048)
	case jose.ES256:
		priv, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	default:
		return nil, fmt.Errorf("oidctest: unsupported algorithm %s", alg)
	}
	if err != nil {
		return nil, err
	}
	return &Key{ID: fmt.Sprintf("key-%d-%s", keySeq.Add(1), alg), Algorithm: alg, private: priv}, nil
}

func (k *Key) public() jose.JSONWebKey {
	return jose.JSONWebKey{Key: k.private.Public(), KeyID: k.ID, Algorithm: string(k.Algorithm), Use: "sig"}
}

// Sign signs claims (any JSON object) as a compact JWS with the key's kid.
func (k *Key) Sign(claims any) (string, error) {
	payload, err := json.Marshal(claims)
	if err != nil {
		return "", err
	}
	signer, err := jose.NewSigner(
		jose.SigningKey{Algorithm: k.Algorithm, Key: jose.JSONWebKey{Key: k.private, KeyID: k.ID}},
		(&jose.SignerOptions{}).WithType("JWT"),
	)
	if err != nil {
		return "", err
	}
	obj, err := signer.Sign(payload)
	if err != nil {
		return "", err
	}
	return obj.CompactSerialize()
}

// Claims are an id_token's claims. Zero fields take the Provider's defaults:
// Issuer the provider's URL, Subject "user-1", Audience the provider's
// default audience, IssuedAt now, Expiry an hour from now.
type Claims struct {
	Issuer    string
	Subject   string
	Audience  []string
	Email     string
	Name      string
	Groups    []string
	IssuedAt  time.Time
	Expiry    time.Time
	NotBefore time.Time
	// NoExpiry leaves exp out.
	NoExpiry bool
	// Extra claims, merged last.
	Extra map[string]any
}

// Provider is a running OpenID Provider.
type Provider struct {
	// Audience is the aud of tokens whose Claims name none.
	Audience string

	srv     *httptest.Server
	mu      sync.Mutex
	keys    []*Key // published in the JWKS
	signing *Key
	fetches atomic.Int64
	header  http.Header   // added to JWKS answers
	delay   time.Duration // before each JWKS answer
	status  int           // of JWKS answers; 0: 200 with the keys

	clients map[string][]string // client id → redirect URIs
	user    Claims              // whom /authorize signs in
	codes   map[string]pendingCode
	grants  []Grant
}

// Start runs a provider with one RS256 key until the test ends.
func Start(tb testing.TB) *Provider {
	tb.Helper()
	p, err := New()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(p.Close)
	return p
}

// New runs a provider with one RS256 key; Close stops it.
func New() (*Provider, error) {
	k, err := NewKey(jose.RS256)
	if err != nil {
		return nil, err
	}
	p := &Provider{Audience: "vm-manager", keys: []*Key{k}, signing: k}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /.well-known/openid-configuration", p.discovery)
	mux.HandleFunc("GET /keys", p.jwks)
	mux.HandleFunc("GET /authorize", p.authorize)
	mux.HandleFunc("POST /token", p.token)
	p.srv = httptest.NewServer(mux)
	return p, nil
}

// Close stops the server.
func (p *Provider) Close() { p.srv.Close() }

// Issuer is the provider's issuer URL (http://127.0.0.1:<port>).
func (p *Provider) Issuer() string { return p.srv.URL }

// JWKSFetches counts the JWKS requests served so far.
func (p *Provider) JWKSFetches() int { return int(p.fetches.Load()) }

func (p *Provider) discovery(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, map[string]any{
		"issuer":                                p.Issuer(),
		"jwks_uri":                              p.Issuer() + "/keys",
		"authorization_endpoint":                p.Issuer() + "/authorize",
		"token_endpoint":                        p.Issuer() + "/token",
		"response_types_supported":              []string{"code"},
		"subject_types_supported":               []string{"public"},
		"id_token_signing_alg_values_supported": []string{"RS256", "ES256"},
		"scopes_supported":                      []string{"openid", "email", "profile", "groups"},
		"grant_types_supported":                 []string{"authorization_code"},
		"code_challenge_methods_supported":      []string{"S256"},
		"token_endpoint_auth_methods_supported": []string{"none"},
		// The authorization response names the issuer (RFC 9207), so a
		// client talking to several cannot be sent another's code.
		"authorization_response_iss_parameter_supported": true,
	})
}

func (p *Provider) jwks(w http.ResponseWriter, r *http.Request) {
	p.fetches.Add(1)
	p.mu.Lock()
	set := jose.JSONWebKeySet{}
	for _, k := range p.keys {
		set.Keys = append(set.Keys, k.public())
	}
	header, delay, status := p.header.Clone(), p.delay, p.status
	p.mu.Unlock()
	select {
	case <-time.After(delay):
	case <-r.Context().Done():
		return
	}
	for k, vs := range header {
		w.Header()[k] = vs
	}
	if status != 0 {
		http.Error(w, http.StatusText(status), status)
		return
	}
	writeJSON(w, set)
}

// SetJWKSHeader sets a header of the JWKS answers from now on (Cache-Control,
// Expires, Date); an empty value removes it.
func (p *Provider) SetJWKSHeader(name, value string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.header == nil {
		p.header = http.Header{}
	}
	if value == "" {
		p.header.Del(name)
		return
	}
	p.header.Set(name, value)
}

// SetJWKSDelay makes every JWKS answer wait d, so that verifiers' fetches
// overlap.
func (p *Provider) SetJWKSDelay(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.delay = d
}

// SetJWKSStatus makes JWKS answers fail with status (a 5xx, say); 0 serves
// the keys again.
func (p *Provider) SetJWKSStatus(status int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.status = status
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

// SigningKey is the key tokens are signed with.
func (p *Provider) SigningKey() *Key {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.signing
}

// AddKey publishes k in the JWKS without signing with it.
func (p *Provider) AddKey(k *Key) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.keys = append(p.keys, k)
}

// RemoveKey takes the key with kid out of the JWKS.
func (p *Provider) RemoveKey(kid string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, k := range p.keys {
		if k.ID == kid {
			p.keys = append(p.keys[:i], p.keys[i+1:]...)
			return
		}
	}
}

// Rotate generates a key for alg, publishes it and signs with it from now on.
// The old keys stay published (RemoveKey retires them).
func (p *Provider) Rotate(alg jose.SignatureAlgorithm) (*Key, error) {
	k, err := NewKey(alg)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.keys = append(p.keys, k)
	p.signing = k
	return k, nil
}

// Claims returns c's JSON claims with the provider's defaults filled in.
func (p *Provider) Claims(c Claims) map[string]any {
	now := time.Now()
	if c.Issuer == "" {
		c.Issuer = p.Issuer()
	}
	if c.Subject == "" {
		c.Subject = "user-1"
	}
	if c.Audience == nil {
		c.Audience = []string{p.Audience}
	}
	if c.IssuedAt.IsZero() {
		c.IssuedAt = now
	}
	if c.Expiry.IsZero() {
		c.Expiry = now.Add(time.Hour)
	}
	m := map[string]any{
		"iss": c.Issuer,
		"sub": c.Subject,
		"aud": c.Audience,
		"iat": c.IssuedAt.Unix(),
	}
	if !c.NoExpiry {
		m["exp"] = c.Expiry.Unix()
	}
	if !c.NotBefore.IsZero() {
		m["nbf"] = c.NotBefore.Unix()
	}
	if c.Email != "" {
		m["email"] = c.Email
		m["email_verified"] = true
	}
	if c.Name != "" {
		m["name"] = c.Name
	}
	if c.Groups != nil {
		m["groups"] = c.Groups
	}
	for k, v := range c.Extra {
		m[k] = v
	}
	return m
}

// Token mints an id_token with the current signing key. It panics on a
// signing error, which only a broken key can cause.
func (p *Provider) Token(c Claims) string {
	return p.TokenWith(p.SigningKey(), c)
}

// TokenWith mints an id_token signed with k, published or not.
func (p *Provider) TokenWith(k *Key, c Claims) string {
	tok, err := k.Sign(p.Claims(c))
	if err != nil {
		panic(fmt.Sprintf("oidctest: sign: %v", err))
	}
	return tok
}

// Unsigned mints a token with "alg":"none" and an empty signature.
func (p *Provider) Unsigned(c Claims) string {
	header, _ := json.Marshal(map[string]string{"alg": "none", "typ": "JWT"})
	payload, _ := json.Marshal(p.Claims(c))
	enc := base64.RawURLEncoding
	return enc.EncodeToString(header) + "." + enc.EncodeToString(payload) + "."
}
