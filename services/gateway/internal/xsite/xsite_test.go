package xsite

import (
	"context"
	"encoding/json"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// request builds a request as the server sees it: Host, headers, body,
// and the local address the connection arrived at.
func request(method, path, host string, local string, body string, header ...string) *http.Request {
	var r *http.Request
	if body == "" {
		r = httptest.NewRequest(method, path, nil)
	} else {
		r = httptest.NewRequest(method, path, strings.NewReader(body))
	}
	r.Host = host
	for i := 0; i+1 < len(header); i += 2 {
		r.Header.Add(header[i], header[i+1])
	}
	if local != "" {
		addr, err := net.ResolveTCPAddr("tcp", local)
		if err != nil {
			panic(err)
		}
		r = r.WithContext(context.WithValue(r.Context(), http.LocalAddrContextKey, net.Addr(addr)))
	}
	return r
}

type refusal struct{ surface, reason string }

func guard(t *testing.T, cfg Config) (http.Handler, *[]refusal) {
	t.Helper()
	var got []refusal
	cfg.Refused = func(s, r string) { got = append(got, refusal{s, r}) }
	g, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return g.Handler(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(299) })), &got
}

func TestAnonymousHostsAndOrigins(t *testing.T) {
	h, refused := guard(t, Config{
		CheckHosts:   true,
		Listen:       "127.0.0.1:8080",
		AllowedHosts: []string{"vmm.example.com", "Kubectl.Local:9000", "[fd00::1]:8443", " "},
		Exempt:       func(r *http.Request) bool { return r.URL.Path == "/healthz" },
	})
	const json = "application/json"
	body := `{"name":"x","cidr":"10.77.0.0/24"}`
	for _, tc := range []struct {
		name         string
		host, local  string
		origin       string
		code         int
		reason, text string
	}{
		{"listen address", "127.0.0.1:8080", "127.0.0.1:8080", "", 299, "", ""},
		{"localhost", "localhost:8080", "127.0.0.1:8080", "http://localhost:8080", 299, "", ""},
		{"LOCALHOST", "LOCALHOST:8080", "127.0.0.1:8080", "", 299, "", ""},
		{"IPv6 loopback", "[::1]:8080", "[::1]:8080", "http://[::1]:8080", 299, "", ""},
		{"same-origin page of the gateway", "127.0.0.1:8080", "127.0.0.1:8080", "http://127.0.0.1:8080", 299, "", ""},
		{"allowed name, any port", "vmm.example.com", "127.0.0.1:8080", "https://vmm.example.com", 299, "", ""},
		{"allowed name with its port", "kubectl.local:9000", "127.0.0.1:8080", "http://kubectl.local:9000", 299, "", ""},
		{"allowed IPv6 with its port", "[fd00::1]:8443", "127.0.0.1:8080", "https://[FD00::1]:8443", 299, "", ""},

		{"DNS rebinding: the page's own name", "evil.example:8080", "127.0.0.1:8080", "http://evil.example:8080", 403, "host", `Host "evil.example:8080" is not allowed`},
		{"rebinding without Origin", "rebind.evil.example:8080", "127.0.0.1:8080", "", 403, "host", "is not allowed"},
		{"the report's curl", "evil.example", "127.0.0.1:8080", "http://evil.example", 403, "host", "is not allowed"},
		{"no Host", "", "127.0.0.1:8080", "", 403, "host", `Host "" is not allowed`},
		{"localhost, another port", "localhost:9000", "127.0.0.1:8080", "", 403, "host", "is not allowed"},
		{"localhost without a port (80)", "localhost", "127.0.0.1:8080", "", 403, "host", "is not allowed"},
		{"allowed name, another port", "kubectl.local:9001", "127.0.0.1:8080", "", 403, "host", "is not allowed"},
		{"suffix of an allowed name", "evil-vmm.example.com", "127.0.0.1:8080", "", 403, "host", "is not allowed"},
		{"allowed name as a subdomain", "vmm.example.com.evil.example", "127.0.0.1:8080", "", 403, "host", "is not allowed"},
		{"cross-site page", "127.0.0.1:8080", "127.0.0.1:8080", "http://evil.example", 403, "origin", `Origin "http://evil.example" is not allowed: cross-site requests are refused`},
		{"cross-site page on another local port", "localhost:8080", "127.0.0.1:8080", "http://localhost:3000", 403, "origin", "cross-site"},
		{"opaque origin", "127.0.0.1:8080", "127.0.0.1:8080", "null", 403, "origin", "cross-site"},
		{"file origin", "127.0.0.1:8080", "127.0.0.1:8080", "file://", 403, "origin", "cross-site"},
		{"other scheme", "127.0.0.1:8080", "127.0.0.1:8080", "ws://127.0.0.1:8080", 403, "origin", "cross-site"},
		{"https default port", "127.0.0.1:8080", "127.0.0.1:8080", "https://localhost", 403, "origin", "cross-site"},
		{"origin with a path", "127.0.0.1:8080", "127.0.0.1:8080", "http://127.0.0.1:8080/x", 403, "origin", "cross-site"},
		{"origin with userinfo", "127.0.0.1:8080", "127.0.0.1:8080", "http://evil@127.0.0.1:8080", 403, "origin", "cross-site"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			*refused = nil
			hdr := []string{"Content-Type", json}
			if tc.origin != "" {
				hdr = append(hdr, "Origin", tc.origin)
			}
			w := httptest.NewRecorder()
			h.ServeHTTP(w, request("POST", "/api/v1/networks", tc.host, tc.local, body, hdr...))
			if w.Code != tc.code {
				t.Fatalf("status %d, want %d: %s", w.Code, tc.code, w.Body)
			}
			if tc.code == 299 {
				if len(*refused) != 0 {
					t.Errorf("counted %v for a request let through", *refused)
				}
				return
			}
			expectEnvelope(t, w, "forbidden", tc.text)
			if want := []refusal{{"rest", tc.reason}}; len(*refused) != 1 || (*refused)[0] != want[0] {
				t.Errorf("counted %v, want %v", *refused, want)
			}
		})
	}

	// MCP is the same surface for the guard, counted as mcp; the exempt
	// probes are not checked at all.
	*refused = nil
	w := httptest.NewRecorder()
	h.ServeHTTP(w, request("POST", "/mcp", "evil.example:8080", "127.0.0.1:8080", `{"jsonrpc":"2.0"}`, "Content-Type", json))
	if w.Code != 403 || len(*refused) != 1 || (*refused)[0] != (refusal{"mcp", "host"}) {
		t.Errorf("MCP with a rebinding Host: %d, counted %v", w.Code, *refused)
	}
	w = httptest.NewRecorder()
	h.ServeHTTP(w, request("GET", "/healthz", "evil.example:8080", "127.0.0.1:8080", ""))
	if w.Code != 299 {
		t.Errorf("exempt /healthz with a foreign Host: %d", w.Code)
	}
}

// TestListenOnAllAddresses: a gateway on every address answers the address
// a connection arrived at (a literal is no rebinding) and its own listen
// port only.
func TestListenOnAllAddresses(t *testing.T) {
	h, _ := guard(t, Config{CheckHosts: true, Listen: "0.0.0.0:8080"})
	for _, tc := range []struct {
		host, local string
		code        int
	}{
		{"10.1.2.3:8080", "10.1.2.3:8080", 299},
		{"localhost:8080", "127.0.0.1:8080", 299},
		{"10.1.2.4:8080", "10.1.2.3:8080", 403}, // not where it arrived
		{"10.1.2.3:8081", "10.1.2.3:8080", 403},
		{"0.0.0.0:8080", "10.1.2.3:8080", 403},
		{"node1:8080", "10.1.2.3:8080", 403},
	} {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, request("GET", "/api/v1/vms", tc.host, tc.local, ""))
		if w.Code != tc.code {
			t.Errorf("Host %s arriving at %s: %d, want %d", tc.host, tc.local, w.Code, tc.code)
		}
	}
	// A listen address given by name allows that name.
	h, _ = guard(t, Config{CheckHosts: true, Listen: "node1:8080"})
	w := httptest.NewRecorder()
	h.ServeHTTP(w, request("GET", "/api/v1/vms", "NODE1:8080", "10.1.2.3:8080", ""))
	if w.Code != 299 {
		t.Errorf("Host of the listen name: %d", w.Code)
	}
}

func TestContentType(t *testing.T) {
	for _, checkHosts := range []bool{true, false} {
		h, refused := guard(t, Config{CheckHosts: checkHosts, Listen: "127.0.0.1:8080"})
		for _, tc := range []struct {
			name, method, body string
			header             []string
			code               int
			text               string
		}{
			{"JSON", "POST", `{}`, []string{"Content-Type", "application/json"}, 299, ""},
			{"JSON with charset", "POST", `{}`, []string{"Content-Type", "application/json; charset=utf-8"}, 299, ""},
			{"JSON, odd case and spacing", "PUT", `{}`, []string{"Content-Type", "Application/JSON ;charset=UTF-8"}, 299, ""},
			{"bodyless POST (start)", "POST", "", nil, 299, ""},
			{"bodyless DELETE", "DELETE", "", nil, 299, ""},
			{"bodyless POST saying JSON", "POST", "", []string{"Content-Type", "application/json"}, 299, ""},
			{"GET with any type", "GET", "", []string{"Content-Type", "text/plain"}, 299, ""},

			{"text/plain (a fetch without CORS)", "POST", `{"name":"x"}`, []string{"Content-Type", "text/plain"}, 415, `Content-Type "text/plain" is not supported: send the body as application/json`},
			{"text/plain with charset", "POST", `{}`, []string{"Content-Type", "text/plain;charset=UTF-8"}, 415, "is not supported"},
			{"a form (curl -d)", "POST", `{"name":"x"}`, []string{"Content-Type", "application/x-www-form-urlencoded"}, 415, "is not supported"},
			{"multipart form", "POST", "--b--", []string{"Content-Type", "multipart/form-data; boundary=b"}, 415, "is not supported"},
			{"empty form body (start from a form)", "POST", "", []string{"Content-Type", "application/x-www-form-urlencoded"}, 415, "is not supported"},
			{"no type", "POST", `{}`, nil, 415, "a request body needs Content-Type: application/json"},
			{"PATCH without type", "PATCH", `{}`, nil, 415, "needs Content-Type"},
			{"json suffix", "POST", `{}`, []string{"Content-Type", "application/merge-patch+json"}, 415, "is not supported"},
			{"json in a parameter", "POST", `{}`, []string{"Content-Type", "text/plain; x=application/json"}, 415, "is not supported"},
			{"malformed", "POST", `{}`, []string{"Content-Type", "application/json; ="}, 415, "is not supported"},
			{"two types", "POST", `{}`, []string{"Content-Type", "application/json", "Content-Type", "text/plain"}, 415, `"application/json, text/plain"`},
		} {
			*refused = nil
			w := httptest.NewRecorder()
			h.ServeHTTP(w, request(tc.method, "/api/v1/networks", "127.0.0.1:8080", "127.0.0.1:8080", tc.body, tc.header...))
			if w.Code != tc.code {
				t.Errorf("%s (hosts checked %t): %d, want %d: %s", tc.name, checkHosts, w.Code, tc.code, w.Body)
				continue
			}
			if tc.code == 415 {
				expectEnvelope(t, w, "invalid_request", tc.text)
				if len(*refused) != 1 || (*refused)[0] != (refusal{"rest", "content_type"}) {
					t.Errorf("%s: counted %v", tc.name, *refused)
				}
			}
		}
	}
}

// TestOIDCModeSkipsHosts: with a token required, Host and Origin are not
// the guard: a reverse proxy's name needs no configuration.
func TestOIDCModeSkipsHosts(t *testing.T) {
	h, _ := guard(t, Config{CheckHosts: false})
	w := httptest.NewRecorder()
	h.ServeHTTP(w, request("POST", "/api/v1/networks", "vmm.corp.example", "10.0.0.1:8080", `{}`, "Content-Type", "application/json", "Origin", "https://portal.corp.example"))
	if w.Code != 299 {
		t.Errorf("OIDC mode, foreign Host and Origin: %d", w.Code)
	}
}

func TestAllowedHostsValidation(t *testing.T) {
	for _, bad := range []string{"*", "*.example.com", "http://vmm.example.com", "vmm.example.com/x", "vmm:0", "vmm:99999", "vmm:http", "a..b", "vmm_example", "[::1"} {
		if _, err := New(Config{AllowedHosts: []string{bad}}); err == nil {
			t.Errorf("allowed host %q accepted", bad)
		}
	}
	for _, good := range []string{"vmm.example.com", "VMM.Example.com:443", "10.0.0.5", "10.0.0.5:8080", "[fd00::1]:8443", "fd00::1", "localhost:9000"} {
		if _, err := New(Config{AllowedHosts: []string{good}}); err != nil {
			t.Errorf("allowed host %q: %v", good, err)
		}
	}
}

func expectEnvelope(t *testing.T, w *httptest.ResponseRecorder, code, text string) {
	t.Helper()
	var e struct {
		Error struct{ Code, Message string }
	}
	if w.Header().Get("Content-Type") != "application/json" || json.Unmarshal(w.Body.Bytes(), &e) != nil || e.Error.Code != code || !strings.Contains(e.Error.Message, text) {
		t.Errorf("body %q (%s), want %s containing %q", w.Body, w.Header().Get("Content-Type"), code, text)
	}
}
