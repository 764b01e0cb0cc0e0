package identity

import (
	"net/http"
	"strings"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// Realm is the realm of the WWW-Authenticate challenge.
const Realm = "vm-manager"

// HTTP guards next: a request must carry "Authorization: Bearer <token>" with
// a valid token, else it is answered 401 with a WWW-Authenticate challenge
// and the REST error envelope {"error":{"code":"unauthenticated",...}}.
// Requests for which open returns true (health, readiness, metrics, the
// OpenAPI document) pass without a token. The caller's Identity and token are
// put on the request context. A nil verifier passes everything. The gateway
// uses Resource.HTTP, whose challenges also name its metadata.
func (v *Verifier) HTTP(next http.Handler, open func(*http.Request) bool) http.Handler {
	if v == nil {
		return next
	}
	return v.guard(next, open, nil)
}

// guard is HTTP; metadataURL, if set, gives the resource_metadata of each
// request's challenges, which then also go on any 401 next answers.
func (v *Verifier) guard(next http.Handler, open func(*http.Request) bool, metadataURL func(*http.Request) string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if open != nil && open(r) {
			next.ServeHTTP(w, r)
			return
		}
		var meta string
		if metadataURL != nil {
			meta = metadataURL(r)
		}
		values := r.Header.Values("Authorization")
		ctx, err := v.authenticate(r.Context(), values, r.Method+" "+r.URL.Path)
		if err != nil {
			writeUnauthorized(w, meta, len(values) > 0, apierr.MessageOf(err))
			return
		}
		if meta != "" {
			// A token the gateway accepted and a backend refused (a key
			// the backend has not fetched yet, an expiry in between).
			w = &challengeWriter{ResponseWriter: w, challenge: func() string { return challenge(meta, true, "") }}
		}
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// OpenPaths returns an open predicate for HTTP that matches the exact paths
// given, and everything below those ending in "/".
func OpenPaths(paths ...string) func(*http.Request) bool {
	return func(r *http.Request) bool {
		for _, p := range paths {
			if r.URL.Path == p || (strings.HasSuffix(p, "/") && strings.HasPrefix(r.URL.Path, p)) {
				return true
			}
		}
		return false
	}
}

// WriteUnauthorized answers 401 with the Bearer challenge (RFC 6750: with
// error="invalid_token" when a credential was presented) and the REST error
// envelope.
func WriteUnauthorized(w http.ResponseWriter, presented bool, msg string) {
	writeUnauthorized(w, "", presented, msg)
}
