package identity

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"path"
	"strings"

	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// MetadataPath is where the gateway publishes its OAuth 2.0 Protected
// Resource Metadata (RFC 9728); a sub-resource's ("/mcp") is at MetadataPath
// followed by its path, as RFC 9728 §3.1 derives it from the resource URL.
const MetadataPath = "/.well-known/oauth-protected-resource"

// ResourceName is the resource_name of the metadata.
const ResourceName = "vm-manager"

// ResourceConfig says how the gateway describes itself to a client that
// finds its authorization server by itself (an MCP client: 401 → metadata →
// the issuer's discovery → authorization code with PKCE → bearer token).
type ResourceConfig struct {
	// PublicURL is the gateway's URL as clients reach it: https://host[:port]
	// (http only on loopback), optionally with the path prefix a proxy
	// strips. Empty: each request's own scheme and Host.
	PublicURL string
	// Scopes are published as scopes_supported, the scopes a client asks the
	// issuer for (Dex: openid email groups). None: omitted.
	Scopes []string
}

// ResourceFlags defines the gateway's --public-url ($VM_MANAGER_PUBLIC_URL)
// and --oidc-scopes ($VM_MANAGER_OIDC_SCOPES, comma-separated) on fs; the
// returned function reads them once fs is parsed.
func ResourceFlags(fs *cli.FlagSet) func() ResourceConfig {
	public := fs.String("public-url", "VM_MANAGER_PUBLIC_URL", "", "the gateway's URL as clients reach it (https://host[:port][/prefix]; http only on loopback), named as the resource in its OAuth protected resource metadata and WWW-Authenticate challenges (empty: each request's scheme and Host)")
	scopes := fs.StringList("oidc-scopes", "VM_MANAGER_OIDC_SCOPES", nil, "scopes an OAuth client should ask the issuer for, comma-separated, published as scopes_supported in the protected resource metadata (empty: omitted)")
	return func() ResourceConfig { return ResourceConfig{PublicURL: *public, Scopes: *scopes} }
}

// Resource is the gateway as an OAuth 2.0 protected resource of the
// verifier's issuer: it publishes the metadata that names the issuer and
// points every 401 at it. vm-manager stays a resource server: clients get
// their tokens from the issuer itself.
type Resource struct {
	v      *Verifier
	base   string   // PublicURL without a trailing slash; "" derives it per request
	scopes []string // scopes_supported
	subs   []string // sub-resources with metadata of their own
}

// NewResource validates cfg. subs are the paths that are resources of their
// own ("/mcp"): requests at or below one are pointed at its metadata, all
// others at the gateway's. A nil verifier (anonymous API) publishes nothing
// and challenges no one.
func NewResource(v *Verifier, cfg ResourceConfig, subs ...string) (*Resource, error) {
	base, err := parsePublicURL(cfg.PublicURL)
	if err != nil {
		return nil, err
	}
	var scopes []string
	for _, s := range cfg.Scopes {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		if !validScope(s) {
			return nil, fmt.Errorf("oidc scope %q: a scope is printable ASCII without spaces, '\"' or '\\'", s)
		}
		scopes = append(scopes, s)
	}
	for _, s := range subs {
		if !strings.HasPrefix(s, "/") || s != path.Clean(s) || s == "/" {
			return nil, fmt.Errorf("sub-resource %q: want a clean absolute path", s)
		}
	}
	return &Resource{v: v, base: base, scopes: scopes, subs: subs}, nil
}

// parsePublicURL checks --public-url: an http(s) URL with a host, no
// credentials, query or fragment, a clean path, and https unless the host is
// loopback (OAuth 2.1, RFC 9728: clients refuse plain http elsewhere).
func parsePublicURL(s string) (string, error) {
	if s == "" {
		return "", nil
	}
	u, err := url.Parse(s)
	if err != nil {
		return "", fmt.Errorf("public URL %q: %w", s, err)
	}
	p := strings.TrimSuffix(u.EscapedPath(), "/")
	switch {
	case u.Scheme != "https" && u.Scheme != "http":
		return "", fmt.Errorf("public URL %q: the scheme must be https (http on loopback)", s)
	case u.Host == "" || u.Opaque != "":
		return "", fmt.Errorf("public URL %q: no host", s)
	case u.User != nil || u.RawQuery != "" || u.ForceQuery || u.Fragment != "" || strings.Contains(s, "#"):
		return "", fmt.Errorf("public URL %q: must not have credentials, a query or a fragment", s)
	case p != "" && p != path.Clean(p):
		return "", fmt.Errorf("public URL %q: the path must be clean", s)
	case u.Scheme == "http" && !isLoopback(u.Hostname()):
		return "", fmt.Errorf("public URL %q: http only on loopback; clients reach a remote gateway over https", s)
	}
	return u.Scheme + "://" + u.Host + p, nil
}

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// validScope is RFC 6749 §3.3's scope-token: %x21 / %x23-5B / %x5D-7E.
func validScope(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x21 || c > 0x7e || c == '"' || c == '\\' {
			return false
		}
	}
	return true
}

// baseURL is the gateway's URL for r: the configured one, else r's scheme
// (https only when the gateway itself terminated TLS) and Host. A derived
// URL reflects what the client sent; with an issuer Host is not restricted,
// and only the caller sees the answer, which grants nothing.
func (res *Resource) baseURL(r *http.Request) string {
	if res.base != "" {
		return res.base
	}
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	host := r.Host
	if host == "" { // HTTP/1.0 without Host
		if a, ok := r.Context().Value(http.LocalAddrContextKey).(net.Addr); ok {
			host = a.String()
		}
	}
	return scheme + "://" + host
}

// sub is the sub-resource a request path is at or below, or "".
func (res *Resource) sub(p string) string {
	for _, s := range res.subs {
		if p == s || strings.HasPrefix(p, s+"/") {
			return s
		}
	}
	return ""
}

// metadataURL is the URL of the metadata describing the resource r asked
// for: the one a 401 to r points at.
func (res *Resource) metadataURL(r *http.Request) string {
	return res.baseURL(r) + MetadataPath + res.sub(r.URL.Path)
}

// metadataFor reports whether r asks for a metadata document, and for which
// (sub-)resource.
func (res *Resource) metadataFor(r *http.Request) (sub string, ok bool) {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		return "", false
	}
	if r.URL.Path == MetadataPath {
		return "", true
	}
	for _, s := range res.subs {
		if r.URL.Path == MetadataPath+s {
			return s, true
		}
	}
	return "", false
}

// resourceMetadata is RFC 9728 §2's document, the fields vm-manager uses.
type resourceMetadata struct {
	Resource               string   `json:"resource"`
	AuthorizationServers   []string `json:"authorization_servers"`
	BearerMethodsSupported []string `json:"bearer_methods_supported"`
	ScopesSupported        []string `json:"scopes_supported,omitempty"`
	ResourceName           string   `json:"resource_name"`
}

func (res *Resource) serveMetadata(w http.ResponseWriter, r *http.Request, sub string) {
	b, _ := json.Marshal(resourceMetadata{
		// RFC 9728 §3.3: exactly the URL the client derived the metadata's
		// from (the MCP endpoint's for /mcp); a client compares the two.
		Resource:               res.baseURL(r) + sub,
		AuthorizationServers:   []string{res.v.Issuer()},
		BearerMethodsSupported: []string{"header"},
		ScopesSupported:        res.scopes,
		ResourceName:           ResourceName,
	})
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(append(b, '\n'))
}

// HTTP is Verifier.HTTP with discovery: it serves the metadata (GET and
// HEAD at MetadataPath and below it for each sub-resource) without a token,
// and every 401, its own or one a handler behind it answers (a backend that
// refuses a token the gateway accepted), carries
// WWW-Authenticate: Bearer resource_metadata="<its URL>". A nil verifier
// passes everything: no metadata (404 from next), no 401s.
func (res *Resource) HTTP(next http.Handler, open func(*http.Request) bool) http.Handler {
	if res.v == nil {
		return next
	}
	guarded := res.v.guard(next, open, res.metadataURL)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if sub, ok := res.metadataFor(r); ok {
			res.serveMetadata(w, r, sub)
			return
		}
		guarded.ServeHTTP(w, r)
	})
}

// challengeWriter adds the challenge to a 401 a handler answers without one.
type challengeWriter struct {
	http.ResponseWriter
	challenge func() string // built only for a 401
}

func (c *challengeWriter) WriteHeader(code int) {
	if code == http.StatusUnauthorized && c.Header().Get("WWW-Authenticate") == "" {
		c.Header().Set("WWW-Authenticate", c.challenge())
	}
	c.ResponseWriter.WriteHeader(code)
}

// Unwrap lets http.ResponseController reach the connection's writer. A
// Write without WriteHeader is a 200: nothing to add there.
func (c *challengeWriter) Unwrap() http.ResponseWriter { return c.ResponseWriter }

// Flush keeps MCP's event streams flowing through the wrapper.
func (c *challengeWriter) Flush() { _ = http.NewResponseController(c.ResponseWriter).Flush() }

// challenge is the Bearer challenge of RFC 6750 §3 with RFC 9728 §5.1's
// resource_metadata; error="invalid_token" when a credential was presented.
func challenge(metadataURL string, presented bool, msg string) string {
	c := `Bearer realm="` + Realm + `"`
	if metadataURL != "" {
		c += `, resource_metadata="` + quoted(metadataURL) + `"`
	}
	if presented {
		c += `, error="invalid_token"`
		if msg != "" {
			c += `, error_description="` + quoted(msg) + `"`
		}
	}
	return c
}

// quoted escapes s for a quoted-string (RFC 9110 §5.6.4); the header
// writer already turns line breaks into spaces.
func quoted(s string) string {
	return strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(s)
}

// writeUnauthorized answers 401 with the challenge and the REST envelope.
func writeUnauthorized(w http.ResponseWriter, metadataURL string, presented bool, msg string) {
	w.Header().Set("WWW-Authenticate", challenge(metadataURL, presented, msg))
	apierr.WriteREST(w, apierr.Errorf(apierr.Unauthenticated, "%s", msg))
}
