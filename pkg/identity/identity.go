// Package identity makes vm-manager an OIDC resource server: it verifies the
// caller's id_token (a JWT forwarded byte-identical by muster, the portal or a
// script) against the issuer's discovery document and JWKS, and puts the
// caller's Identity on the request context.
//
// The gateway verifies every request (HTTP middleware, gRPC interceptors) and
// forwards the caller's authorization to the backends, which verify it again
// with the same settings (defence in depth, each with its own cached JWKS) and
// record the caller on what they create.
//
// Without an issuer the API is anonymous: New returns a nil *Verifier, whose
// middleware and interceptors let everything through.
package identity

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/zitadel/oidc/v3/pkg/client"
	"github.com/zitadel/oidc/v3/pkg/oidc"
)

// ClockSkew is how far the verifier's clock may be from the issuer's: a token
// is accepted up to ClockSkew after its expiry and from ClockSkew before its
// iat or nbf.
const ClockSkew = 30 * time.Second

// Config says which tokens are trusted.
type Config struct {
	// Issuer is the OIDC issuer URL, exactly as the tokens' iss claim spells
	// it. Empty means anonymous: no verification at all.
	Issuer string
	// Audiences are the trusted audiences: a token's aud must contain at
	// least one of them. Required with an Issuer.
	Audiences []string
	// HTTPClient fetches the discovery document and the JWKS; nil uses a
	// client with a 10 s timeout.
	HTTPClient *http.Client
	// Log receives a debug line per authenticated request and per refusal
	// (never the token); nil discards them.
	Log *slog.Logger
	// JWKSRefreshInterval is the longest a fetched key is trusted (the
	// provider's Cache-Control max-age or Expires when shorter); 0 means
	// DefaultJWKSRefreshInterval. At least MinJWKSRefreshInterval.
	JWKSRefreshInterval time.Duration
	// JWKSMinFetchInterval is the least time between two JWKS fetches and
	// the floor of the provider's cache lifetime; 0 means the shorter of
	// DefaultJWKSMinFetchInterval and the refresh interval. Tests shorten it.
	JWKSMinFetchInterval time.Duration
}

// Enabled reports whether callers must present a token.
func (c Config) Enabled() bool { return c.Issuer != "" }

// Identity is the verified caller.
type Identity struct {
	Subject string // sub
	Email   string // email
	Name    string // name
	Groups  []string
}

// String is the caller as recorded on what it creates: the email, else the
// subject; "" for an anonymous caller.
func (i Identity) String() string {
	if i.Email != "" {
		return i.Email
	}
	return i.Subject
}

type identityKey struct{}
type tokenKey struct{}

// NewContext returns ctx carrying id.
func NewContext(ctx context.Context, id Identity) context.Context {
	return context.WithValue(ctx, identityKey{}, id)
}

// FromContext returns the caller on ctx; the zero Identity (String() "") for
// an anonymous one.
func FromContext(ctx context.Context) Identity {
	id, _ := ctx.Value(identityKey{}).(Identity)
	return id
}

// withToken records the raw bearer token a request was authenticated with,
// for forwarding.
func withToken(ctx context.Context, raw string) context.Context {
	return context.WithValue(ctx, tokenKey{}, raw)
}

// BearerFromContext returns the raw token (without "Bearer ") the request on
// ctx was authenticated with, or "".
func BearerFromContext(ctx context.Context) string {
	s, _ := ctx.Value(tokenKey{}).(string)
	return s
}

// supportedAlgs are the signature algorithms accepted when the issuer
// advertises none it shares with this list. Never "none", never HMAC (a
// resource server has no shared secret with the issuer).
var supportedAlgs = []string{"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}

// Verifier verifies tokens of one issuer.
type Verifier struct {
	issuer    string
	audiences []string
	algs      []string
	keys      *keySet
	log       *slog.Logger
	now       func() time.Time
}

// New discovers the issuer (its /.well-known/openid-configuration) and returns
// a verifier whose JWKS is fetched on first use, cached for the refresh
// interval (or the provider's shorter cache lifetime), and fetched again
// before that when a token names a key the cache does not have (key
// rotation), at most once per minimum fetch interval. An empty Issuer
// returns a nil verifier: anonymous.
func New(ctx context.Context, cfg Config) (*Verifier, error) {
	if !cfg.Enabled() {
		return nil, nil
	}
	var auds []string
	for _, a := range cfg.Audiences {
		if a = strings.TrimSpace(a); a != "" {
			auds = append(auds, a)
		}
	}
	if len(auds) == 0 {
		return nil, fmt.Errorf("oidc issuer %s: at least one trusted audience is required", cfg.Issuer)
	}
	refresh, minFetch, err := cfg.jwksIntervals()
	if err != nil {
		return nil, err
	}
	hc := cfg.HTTPClient
	if hc == nil {
		hc = &http.Client{Timeout: 10 * time.Second}
	}
	disc, err := client.Discover(ctx, cfg.Issuer, hc)
	if err != nil {
		if errors.Is(err, oidc.ErrIssuerInvalid) {
			return nil, fmt.Errorf("oidc issuer %s: the discovery document names a different issuer", cfg.Issuer)
		}
		return nil, fmt.Errorf("oidc issuer %s: discovery: %w", cfg.Issuer, err)
	}
	if disc.JwksURI == "" {
		return nil, fmt.Errorf("oidc issuer %s: the discovery document has no jwks_uri", cfg.Issuer)
	}
	var algs []string
	for _, a := range disc.IDTokenSigningAlgValuesSupported {
		if slices.Contains(supportedAlgs, a) && !slices.Contains(algs, a) {
			algs = append(algs, a)
		}
	}
	if len(algs) == 0 {
		algs = supportedAlgs
	}
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Verifier{
		issuer:    cfg.Issuer,
		audiences: auds,
		algs:      algs,
		keys:      &keySet{hc: hc, url: disc.JwksURI, refresh: refresh, minFetch: minFetch, now: time.Now, log: log},
		log:       log,
		now:       time.Now,
	}, nil
}

// jwksIntervals are the refresh and minimum fetch intervals, defaults
// applied; the minimum is never above the refresh interval.
func (c Config) jwksIntervals() (refresh, minFetch time.Duration, err error) {
	refresh, minFetch = c.JWKSRefreshInterval, c.JWKSMinFetchInterval
	switch {
	case refresh == 0:
		refresh = DefaultJWKSRefreshInterval
	case refresh < MinJWKSRefreshInterval:
		return 0, 0, fmt.Errorf("oidc JWKS refresh interval %s: must be at least %s", refresh, MinJWKSRefreshInterval)
	}
	switch {
	case minFetch == 0:
		minFetch = DefaultJWKSMinFetchInterval
	case minFetch < 0:
		return 0, 0, fmt.Errorf("oidc JWKS minimum fetch interval %s: must not be negative", minFetch)
	}
	return refresh, min(minFetch, refresh), nil
}

// KeyStats counts the verifier's JWKS fetches and unknown-key refusals
// (zero for a nil verifier).
func (v *Verifier) KeyStats() KeyStats {
	if v == nil {
		return KeyStats{}
	}
	return v.keys.stats()
}

// Issuer is the trusted issuer ("" for a nil verifier).
func (v *Verifier) Issuer() string {
	if v == nil {
		return ""
	}
	return v.issuer
}

// unauthenticated is the error every refusal returns: the code and a short
// reason, never the token.
func unauthenticated(reason string) error {
	return apierr.Errorf(apierr.Unauthenticated, "%s", reason)
}

// Verify checks a raw JWT: issuer, audience, expiry (with ClockSkew), iat/nbf,
// subject and signature against the issuer's JWKS. Every failure is an
// apierr.Unauthenticated error with a short reason. A nil verifier accepts
// anything as the anonymous caller.
func (v *Verifier) Verify(ctx context.Context, raw string) (Identity, error) {
	if v == nil {
		return Identity{}, nil
	}
	if raw == "" {
		return Identity{}, unauthenticated("missing bearer token")
	}
	var claims *oidc.IDTokenClaims
	payload, err := oidc.ParseToken(raw, &claims)
	if err != nil || claims == nil {
		return Identity{}, unauthenticated("malformed token")
	}
	if claims.Issuer != v.issuer {
		return Identity{}, unauthenticated("token issuer not trusted")
	}
	if !slices.ContainsFunc(v.audiences, func(a string) bool { return slices.Contains(claims.Audience, a) }) {
		return Identity{}, unauthenticated("token audience not trusted")
	}
	now := v.now()
	switch {
	case claims.Expiration == 0:
		return Identity{}, unauthenticated("token has no expiry")
	case !now.Add(-ClockSkew).Before(claims.Expiration.AsTime()):
		return Identity{}, unauthenticated("token expired")
	case claims.IssuedAt != 0 && claims.IssuedAt.AsTime().After(now.Add(ClockSkew)):
		return Identity{}, unauthenticated("token issued in the future")
	case claims.NotBefore != 0 && claims.NotBefore.AsTime().After(now.Add(ClockSkew)):
		return Identity{}, unauthenticated("token not yet valid")
	case claims.Subject == "":
		return Identity{}, unauthenticated("token has no subject")
	}
	if err := oidc.CheckSignature(ctx, raw, payload, claims, v.algs, v.keys); err != nil {
		switch {
		case errors.Is(err, oidc.ErrSignatureUnsupportedAlg):
			return Identity{}, unauthenticated("token signature algorithm not supported")
		case errors.Is(err, oidc.ErrParse):
			return Identity{}, unauthenticated("malformed token")
		case errors.Is(err, errKeysUnavailable), errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
			return Identity{}, unauthenticated("token signing keys unavailable") // the fetch logged why
		default:
			return Identity{}, unauthenticated("token signature invalid")
		}
	}
	return Identity{
		Subject: claims.Subject,
		Email:   claims.Email,
		Name:    claims.Name,
		Groups:  groups(claims.Claims["groups"]),
	}, nil
}

func groups(v any) []string {
	switch g := v.(type) {
	case []any:
		var out []string
		for _, e := range g {
			if s, ok := e.(string); ok {
				out = append(out, s)
			}
		}
		return out
	case string:
		return []string{g}
	}
	return nil
}

// bearer extracts the token from Authorization header values: exactly one
// value, of the form "Bearer <token>" (the scheme is case-insensitive).
func bearer(values []string) (string, error) {
	switch len(values) {
	case 0:
		return "", unauthenticated("missing bearer token")
	case 1:
	default:
		return "", unauthenticated("more than one authorization value")
	}
	scheme, token, _ := strings.Cut(strings.TrimSpace(values[0]), " ")
	if !strings.EqualFold(scheme, "Bearer") {
		return "", unauthenticated("authorization is not a bearer token")
	}
	token = strings.TrimSpace(token)
	if token == "" {
		return "", unauthenticated("missing bearer token")
	}
	return token, nil
}

// authenticate verifies the authorization values of one request.
func (v *Verifier) authenticate(ctx context.Context, values []string, what string) (context.Context, error) {
	raw, err := bearer(values)
	var id Identity
	if err == nil {
		id, err = v.Verify(ctx, raw)
	}
	if err != nil {
		v.log.Debug("request refused", "request", what, "reason", apierr.MessageOf(err))
		return ctx, err
	}
	v.log.Debug("request authenticated", "request", what, "caller", id.String())
	return withToken(NewContext(ctx, id), raw), nil
}

// Flags defines --oidc-issuer ($VM_MANAGER_OIDC_ISSUER), --oidc-audiences
// ($VM_MANAGER_OIDC_AUDIENCES, comma-separated) and
// --oidc-jwks-refresh-interval ($VM_MANAGER_OIDC_JWKS_REFRESH_INTERVAL) on
// fs, the same on every process; the returned function reads them once fs is
// parsed.
func Flags(fs *cli.FlagSet) func() Config {
	issuer := fs.String("oidc-issuer", "VM_MANAGER_OIDC_ISSUER", "", "OIDC issuer URL whose id_tokens callers must present (empty: anonymous API)")
	audiences := fs.StringList("oidc-audiences", "VM_MANAGER_OIDC_AUDIENCES", nil, "trusted token audiences, comma-separated; a token's aud must contain one (required with --oidc-issuer)")
	refresh := fs.Duration("oidc-jwks-refresh-interval", "VM_MANAGER_OIDC_JWKS_REFRESH_INTERVAL", DefaultJWKSRefreshInterval, "longest time a key of the issuer's JWKS is trusted before it is fetched again (shorter if the issuer's Cache-Control says so); a key the issuer retired stops working within it")
	return func() Config {
		return Config{Issuer: *issuer, Audiences: *audiences, JWKSRefreshInterval: *refresh}
	}
}
