package identity

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	jose "github.com/go-jose/go-jose/v4"
	"github.com/zitadel/oidc/v3/pkg/oidc"
)

// The JWKS is what makes a key the provider retired stop working, and the
// one thing a caller can make a verifier fetch: a token whose issuer,
// audience and expiry look right (all written by the caller) and whose kid is
// made up. So both are bounded: cached keys expire, and fetches, whatever
// forces them, start at most once per minimum fetch interval per process,
// concurrent callers sharing the one in flight.
const (
	// DefaultJWKSRefreshInterval is how long fetched keys are trusted when
	// the provider gives no shorter cache lifetime: a key the provider
	// retired stops working within it.
	DefaultJWKSRefreshInterval = 5 * time.Minute
	// DefaultJWKSMinFetchInterval is the least time between two JWKS
	// fetches; a token naming an unknown key within it is refused without
	// one.
	DefaultJWKSMinFetchInterval = 10 * time.Second
	// MinJWKSRefreshInterval is the shortest refresh interval New accepts.
	MinJWKSRefreshInterval = time.Second
	// maxJWKSBytes bounds the provider's answer.
	maxJWKSBytes = 1 << 20
	// jwksFetchTimeout bounds one fetch, whoever waits for it.
	jwksFetchTimeout = 10 * time.Second
)

var (
	errUnknownKey      = errors.New("no key of the issuer's JWKS matches the token")
	errKeysUnavailable = errors.New("the issuer's JWKS is unavailable")
)

// KeyStats count what a verifier's key cache did since it started.
type KeyStats struct {
	// Fetches are the JWKS requests made (at start, on expiry, for an
	// unknown key); FetchErrors those that failed.
	Fetches, FetchErrors uint64
	// UnknownKey are tokens refused because no published key matched their
	// kid and algorithm; FetchesDenied those of them refused from the cache
	// because a fetch had started less than the minimum interval before.
	UnknownKey, FetchesDenied uint64
}

// keySet is an oidc.KeySet over the issuer's jwks_uri.
type keySet struct {
	hc       *http.Client
	url      string
	refresh  time.Duration // lifetime without a shorter one from the provider; its ceiling
	minFetch time.Duration // between fetch starts; the floor of the lifetime
	now      func() time.Time
	log      *slog.Logger

	mu        sync.Mutex
	keys      []jose.JSONWebKey
	expires   time.Time     // zero: nothing cached yet
	lastFetch time.Time     // when the last fetch started; zero: never
	lastErr   error         // of the last fetch that ended
	inflight  chan struct{} // closed when the running fetch ends

	fetches, fetchErrors, unknownKey, denied atomic.Uint64
}

func (s *keySet) stats() KeyStats {
	return KeyStats{
		Fetches:       s.fetches.Load(),
		FetchErrors:   s.fetchErrors.Load(),
		UnknownKey:    s.unknownKey.Load(),
		FetchesDenied: s.denied.Load(),
	}
}

// VerifySignature implements oidc.KeySet.
func (s *keySet) VerifySignature(ctx context.Context, jws *jose.JSONWebSignature) ([]byte, error) {
	kid, alg := oidc.GetKeyIDAndAlg(jws)
	key, err := s.key(ctx, kid, alg)
	if err != nil {
		return nil, err
	}
	return jws.Verify(&key)
}

// key finds the published key for kid and alg, fetching the JWKS when the
// cache has expired or lacks the key, if the rate limit allows.
func (s *keySet) key(ctx context.Context, kid, alg string) (jose.JSONWebKey, error) {
	waited := false // for a fetch, in this call
	s.mu.Lock()
	for {
		if waited && s.lastErr != nil {
			s.mu.Unlock()
			return jose.JSONWebKey{}, errKeysUnavailable
		}
		// Keys a fetch this call waited for are used even if their
		// lifetime ran out while the call was being scheduled.
		fresh := waited || s.now().Before(s.expires)
		if fresh {
			k, err := oidc.FindMatchingKey(kid, oidc.KeyUseSignature, alg, s.keys...)
			switch {
			case err == nil:
				s.mu.Unlock()
				return k, nil
			case errors.Is(err, oidc.ErrKeyMultiple) || waited:
				// Several keys fit a token without a kid (no fetch
				// would single one out), or the fresh JWKS lacks it.
				s.mu.Unlock()
				s.unknownKey.Add(1)
				return k, errUnknownKey
			}
		}
		if s.inflight == nil {
			if !s.lastFetch.IsZero() && s.now().Sub(s.lastFetch) < s.minFetch {
				s.mu.Unlock()
				if fresh {
					s.unknownKey.Add(1)
					s.denied.Add(1)
					return jose.JSONWebKey{}, errUnknownKey
				}
				return jose.JSONWebKey{}, errKeysUnavailable // the last fetch failed
			}
			s.inflight, s.lastFetch = make(chan struct{}), s.now()
			go s.refreshKeys(context.WithoutCancel(ctx), s.inflight)
		}
		done := s.inflight
		s.mu.Unlock()
		select {
		case <-done:
		case <-ctx.Done():
			return jose.JSONWebKey{}, ctx.Err()
		}
		waited = true
		s.mu.Lock()
	}
}

// refreshKeys runs one fetch and publishes its outcome; a failed fetch keeps
// the keys cached before, until they expire.
func (s *keySet) refreshKeys(ctx context.Context, done chan struct{}) {
	keys, lifetime, err := s.fetch(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.lastErr = err
	if err == nil {
		s.keys, s.expires = keys, s.now().Add(lifetime)
	}
	s.inflight = nil
	close(done)
}

func (s *keySet) fetch(ctx context.Context) ([]jose.JSONWebKey, time.Duration, error) {
	s.fetches.Add(1)
	keys, lifetime, err := s.get(ctx)
	if err != nil {
		s.fetchErrors.Add(1)
		s.log.Warn("oidc: JWKS fetch failed", "url", s.url, "error", err)
		return nil, 0, err
	}
	s.log.Debug("oidc: JWKS fetched", "url", s.url, "keys", len(keys), "lifetime", lifetime)
	return keys, lifetime, nil
}

func (s *keySet) get(ctx context.Context) ([]jose.JSONWebKey, time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, jwksFetchTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.url, nil)
	if err != nil {
		return nil, 0, err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := s.hc.Do(req)
	if err != nil {
		return nil, 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, 0, fmt.Errorf("status %s", resp.Status)
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxJWKSBytes+1))
	if err != nil {
		return nil, 0, err
	}
	if len(body) > maxJWKSBytes {
		return nil, 0, fmt.Errorf("larger than %d bytes", maxJWKSBytes)
	}
	keys, err := parseJWKS(body)
	if err != nil {
		return nil, 0, err
	}
	return keys, s.lifetime(resp.Header), nil
}

// parseJWKS reads a JWKS, keeping the public keys it understands: one key
// of a type go-jose does not know (a new curve, say) must not take the
// others down with it.
func parseJWKS(body []byte) ([]jose.JSONWebKey, error) {
	var raw struct {
		Keys []json.RawMessage `json:"keys"`
	}
	if err := json.Unmarshal(body, &raw); err != nil {
		return nil, fmt.Errorf("not a JWKS: %w", err)
	}
	var keys []jose.JSONWebKey
	for _, r := range raw.Keys {
		var k jose.JSONWebKey
		if json.Unmarshal(r, &k) != nil {
			continue
		}
		// Public drops private parts a broken provider published, and
		// leaves nothing of a symmetric key.
		if k = k.Public(); k.Valid() {
			keys = append(keys, k)
		}
	}
	return keys, nil
}

// lifetime is how long a JWKS answer is trusted: the provider's cache
// lifetime bounded to [minFetch, refresh], else refresh.
func (s *keySet) lifetime(h http.Header) time.Duration {
	d, ok := cacheLifetime(h, s.now())
	if !ok {
		return s.refresh
	}
	return min(max(d, s.minFetch), s.refresh)
}

// cacheLifetime is the lifetime an HTTP answer gives itself: Cache-Control
// max-age (no-store and no-cache: none at all), else Expires less Date.
func cacheLifetime(h http.Header, now time.Time) (time.Duration, bool) {
	for _, v := range h.Values("Cache-Control") {
		for _, d := range strings.Split(v, ",") {
			name, val, _ := strings.Cut(strings.TrimSpace(d), "=")
			switch strings.ToLower(name) {
			case "no-store", "no-cache":
				return 0, true
			case "max-age":
				n, err := strconv.ParseInt(strings.Trim(val, `"`), 10, 64)
				if err != nil || n < 0 {
					return 0, true // RFC 9111: an invalid max-age is stale
				}
				return time.Duration(min(n, int64(365*24*3600))) * time.Second, true
			}
		}
	}
	exp := h.Get("Expires")
	if exp == "" {
		return 0, false
	}
	t, err := http.ParseTime(exp)
	if err != nil {
		return 0, true // RFC 9111: an invalid Expires ("0") is in the past
	}
	if date, err := http.ParseTime(h.Get("Date")); err == nil {
		now = date
	}
	return max(t.Sub(now), 0), true
}
