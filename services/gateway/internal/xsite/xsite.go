// Package xsite keeps web pages out of the gateway's HTTP API. A page the
// operator opens in a browser can send "simple" requests to any address (a
// form post, fetch without CORS: text/plain or form bodies, no preflight),
// and with DNS rebinding (its own name resolving to 127.0.0.1) it is even
// same-origin with the gateway and can read the answers. So:
//
//   - a request with a body must say Content-Type: application/json, which a
//     page can send cross-site only after a CORS preflight the gateway never
//     grants (415 otherwise, in every mode);
//   - an anonymous gateway answers only requests whose Host is its listen
//     address, a loopback name or address with its port, or an allowed host,
//     and whose Origin, when sent, is one of those (403 otherwise). A
//     rebinding page's Host is its own name; a cross-site page's Origin is
//     its own.
//
// With OIDC the bearer token is the guard: a browser never attaches one by
// itself. Refusals carry the REST error envelope and are counted.
package xsite

import (
	"fmt"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// Reasons a request is refused, the values of the refusal counter's reason
// label.
const (
	ReasonContentType = "content_type"
	ReasonHost        = "host"
	ReasonOrigin      = "origin"
)

// Config says what the guard lets through.
type Config struct {
	// CheckHosts turns on the Host and Origin rules (the anonymous API).
	CheckHosts bool
	// Listen is the gateway's listen address, host as configured and the
	// port it bound: with that port, its host (unless unspecified),
	// localhost, 127.0.0.1, [::1] and the address a connection arrived at
	// are allowed hosts.
	Listen string
	// AllowedHosts are further names (or addresses) callers may use: "name"
	// matches any port, "name:port" that port only.
	AllowedHosts []string
	// Exempt requests pass unchecked: probes, metrics, the OpenAPI document.
	Exempt func(*http.Request) bool
	// Refused, if set, is told of each refusal: the surface ("rest" or
	// "mcp") and the reason.
	Refused func(surface, reason string)
	// Log gets a debug line per refusal; nil discards them.
	Log *slog.Logger
}

// Guard is the cross-site check in front of the gateway's HTTP handlers.
type Guard struct {
	cfg        Config
	listenHost string // "" when the listener is on every address
	listenPort string
	allowed    []hostPort
}

type hostPort struct{ host, port string } // port "" matches any

// New validates cfg.
func New(cfg Config) (*Guard, error) {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	g := &Guard{cfg: cfg}
	if cfg.CheckHosts {
		host, port, err := net.SplitHostPort(cfg.Listen)
		if err != nil {
			return nil, fmt.Errorf("xsite: listen address %q: %w", cfg.Listen, err)
		}
		if ip := net.ParseIP(normalHost(host)); host != "" && (ip == nil || !ip.IsUnspecified()) {
			g.listenHost = normalHost(host)
		}
		g.listenPort = port
	}
	for _, a := range cfg.AllowedHosts {
		a = strings.TrimSpace(a)
		if a == "" {
			continue
		}
		hp, err := parseAllowed(a)
		if err != nil {
			return nil, err
		}
		g.allowed = append(g.allowed, hp)
	}
	return g, nil
}

// parseAllowed reads an --allowed-hosts entry: a DNS name or an IP address
// (IPv6 in brackets when with a port), optionally with a port.
func parseAllowed(s string) (hostPort, error) {
	bad := func(why string) (hostPort, error) {
		return hostPort{}, fmt.Errorf("allowed host %q: %s", s, why)
	}
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		host, port = s, ""
	} else if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return bad("the port must be a number from 1 to 65535")
	}
	if strings.HasPrefix(host, "[") != strings.HasSuffix(host, "]") {
		return bad("unbalanced brackets")
	}
	host = normalHost(host)
	if net.ParseIP(host) != nil {
		return hostPort{host, port}, nil
	}
	if host == "" || len(host) > 253 || strings.Trim(host, "abcdefghijklmnopqrstuvwxyz0123456789.-") != "" || strings.Contains(host, "..") {
		return bad("want a DNS name or an IP address, optionally with :port (no scheme, path or wildcard)")
	}
	return hostPort{host, port}, nil
}

// normalHost lowercases a host and takes the brackets off an IPv6 address.
func normalHost(h string) string {
	return strings.ToLower(strings.TrimSuffix(strings.TrimPrefix(h, "["), "]"))
}

// Handler checks each request before next serves it.
func (g *Guard) Handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if g.cfg.Exempt != nil && g.cfg.Exempt(r) {
			next.ServeHTTP(w, r)
			return
		}
		if reason, err := g.check(r); err != nil {
			g.refuse(w, r, reason, err)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (g *Guard) check(r *http.Request) (string, error) {
	if g.cfg.CheckHosts {
		if !g.allowedHost(r, r.Host, "80") {
			return ReasonHost, apierr.Errorf(apierr.Forbidden, "Host %q is not allowed: the anonymous API answers its listen address, localhost and --allowed-hosts only", r.Host)
		}
		if origins := r.Header.Values("Origin"); len(origins) > 0 {
			if len(origins) > 1 || !g.allowedOrigin(r, origins[0]) {
				return ReasonOrigin, apierr.Errorf(apierr.Forbidden, "Origin %q is not allowed: cross-site requests are refused", strings.Join(origins, ", "))
			}
		}
	}
	return checkContentType(r)
}

// checkContentType requires application/json of any request that has a
// body or says what its body is, whatever the method's routes read: GET and
// HEAD excepted (no route reads their body). A bodyless POST without a
// Content-Type (curl -XPOST …/start) passes.
func checkContentType(r *http.Request) (string, error) {
	if r.Method == http.MethodGet || r.Method == http.MethodHead {
		return "", nil
	}
	cts := r.Header.Values("Content-Type")
	if len(cts) == 0 && r.ContentLength == 0 {
		return "", nil
	}
	if len(cts) == 1 {
		if mt, _, err := mime.ParseMediaType(cts[0]); err == nil && mt == "application/json" {
			return "", nil
		}
	}
	if len(cts) == 0 {
		return ReasonContentType, apierr.Errorf(apierr.InvalidRequest, "a request body needs Content-Type: application/json")
	}
	return ReasonContentType, apierr.Errorf(apierr.InvalidRequest, "Content-Type %q is not supported: send the body as application/json", strings.Join(cts, ", "))
}

// allowedHost reports whether hostport (a Host header, or an Origin's host)
// names this gateway: the listen host, a loopback name or address, or the
// address the connection arrived at, each with the listen port; or an
// allowed host. defPort is the port a hostport without one means.
func (g *Guard) allowedHost(r *http.Request, hostport, defPort string) bool {
	if hostport == "" {
		return false
	}
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		host, port = hostport, defPort
	}
	host = normalHost(host)
	if port == g.listenPort {
		if host == "localhost" || host == "127.0.0.1" || host == "::1" || (host != "" && host == g.listenHost) {
			return true
		}
		// An address literal of this machine is no rebinding: the page's
		// origin would be the gateway itself.
		if local, ok := r.Context().Value(http.LocalAddrContextKey).(net.Addr); ok && local != nil {
			if lh, _, err := net.SplitHostPort(local.String()); err == nil && normalHost(lh) == host {
				return true
			}
		}
	}
	for _, a := range g.allowed {
		if a.host == host && (a.port == "" || a.port == port) {
			return true
		}
	}
	return false
}

// allowedOrigin reports whether an Origin header names an allowed host over
// http or https.
func (g *Guard) allowedOrigin(r *http.Request, origin string) bool {
	u, err := url.Parse(origin)
	if err != nil || u.Host == "" || u.User != nil || (u.Path != "" && u.Path != "/") || u.RawQuery != "" || u.Fragment != "" {
		return false // "null" (sandboxed frames, file:) among them
	}
	switch strings.ToLower(u.Scheme) {
	case "http":
		return g.allowedHost(r, u.Host, "80")
	case "https":
		return g.allowedHost(r, u.Host, "443")
	}
	return false
}

func (g *Guard) refuse(w http.ResponseWriter, r *http.Request, reason string, err error) {
	surface := "rest"
	if r.URL.Path == "/mcp" || strings.HasPrefix(r.URL.Path, "/mcp/") {
		surface = "mcp"
	}
	if g.cfg.Refused != nil {
		g.cfg.Refused(surface, reason)
	}
	g.cfg.Log.Debug("cross-site request refused", "surface", surface, "reason", reason, "method", r.Method, "path", r.URL.Path, "host", r.Host, "origin", r.Header.Get("Origin"))
	status := apierr.HTTPStatus(apierr.CodeOf(err))
	if reason == ReasonContentType {
		status = http.StatusUnsupportedMediaType
	}
	apierr.WriteRESTStatus(w, status, err)
}
