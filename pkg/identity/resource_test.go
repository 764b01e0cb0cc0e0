package identity_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/identity/oidctest"
)

// resourceServer serves next behind a Resource with "/mcp" as a
// sub-resource and "/healthz" open; reached counts what got through.
func resourceServer(t *testing.T, v *identity.Verifier, cfg identity.ResourceConfig, next http.HandlerFunc) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	res, err := identity.NewResource(v, cfg, "/mcp")
	if err != nil {
		t.Fatal(err)
	}
	var reached atomic.Int64
	if next == nil {
		next = func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "next") }
	}
	srv := httptest.NewServer(res.HTTP(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reached.Add(1)
		next(w, r)
	}), identity.OpenPaths("/healthz")))
	t.Cleanup(srv.Close)
	return srv, &reached
}

func send(t *testing.T, method, url string, header http.Header) (*http.Response, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, vs := range header {
		req.Header[k] = vs
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

type metadataDoc struct {
	Resource               string   `json:"resource"`
	AuthorizationServers   []string `json:"authorization_servers"`
	BearerMethodsSupported []string `json:"bearer_methods_supported"`
	ScopesSupported        []string `json:"scopes_supported"`
	ResourceName           string   `json:"resource_name"`
}

func TestResourceMetadata(t *testing.T) {
	p := oidctest.Start(t)
	v := newVerifier(t, p)
	for _, tc := range []struct {
		name       string
		cfg        identity.ResourceConfig
		base       func(srv string) string
		wantScopes []string
	}{
		{"derived from the request", identity.ResourceConfig{}, func(srv string) string { return srv }, nil},
		{"public URL and scopes", identity.ResourceConfig{PublicURL: "https://vmm.corp.test/", Scopes: []string{"openid", " email ", "", "groups"}},
			func(string) string { return "https://vmm.corp.test" }, []string{"openid", "email", "groups"}},
		{"public URL with a prefix", identity.ResourceConfig{PublicURL: "https://corp.test:8443/vmm"},
			func(string) string { return "https://corp.test:8443/vmm" }, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv, reached := resourceServer(t, v, tc.cfg, nil)
			base := tc.base(srv.URL)
			for path, resource := range map[string]string{
				identity.MetadataPath:          base,
				identity.MetadataPath + "/mcp": base + "/mcp",
			} {
				resp, body := send(t, "GET", srv.URL+path, nil)
				if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" {
					t.Fatalf("GET %s: %d %q %s", path, resp.StatusCode, resp.Header.Get("Content-Type"), body)
				}
				var doc metadataDoc
				dec := json.NewDecoder(strings.NewReader(body))
				dec.DisallowUnknownFields()
				if err := dec.Decode(&doc); err != nil {
					t.Fatalf("GET %s: %v: %s", path, err, body)
				}
				want := metadataDoc{Resource: resource, AuthorizationServers: []string{p.Issuer()}, BearerMethodsSupported: []string{"header"}, ScopesSupported: tc.wantScopes, ResourceName: "vm-manager"}
				if !reflect.DeepEqual(doc, want) {
					t.Errorf("GET %s:\n got %+v\nwant %+v", path, doc, want)
				}
				if resp, body := send(t, "HEAD", srv.URL+path, nil); resp.StatusCode != 200 || body != "" {
					t.Errorf("HEAD %s: %d %q", path, resp.StatusCode, body)
				}
			}
			if n := reached.Load(); n != 0 {
				t.Errorf("the metadata reached the guarded handler %d times", n)
			}
		})
	}
}

// TestResourceChallenges: every 401 points at the metadata of what was
// asked for, the guard's own and one a handler behind it answers.
func TestResourceChallenges(t *testing.T) {
	p := oidctest.Start(t)
	v := newVerifier(t, p)
	good := "Bearer " + p.Token(oidctest.Claims{})
	srv, _ := resourceServer(t, v, identity.ResourceConfig{}, func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/backend-refuses":
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
		case "/backend-challenges":
			w.Header().Set("WWW-Authenticate", `Bearer realm="other"`)
			w.WriteHeader(http.StatusUnauthorized)
		case "/stream":
			// An event stream is flushed through the guard's writer.
			_, _ = io.WriteString(w, "data: 1\n\n")
			if err := http.NewResponseController(w).Flush(); err != nil {
				t.Errorf("flush through the guard: %v", err)
			}
		}
	})
	root := `resource_metadata="` + srv.URL + identity.MetadataPath + `"`
	mcp := `resource_metadata="` + srv.URL + identity.MetadataPath + `/mcp"`
	for _, tc := range []struct {
		path, auth, want string
		status           int
	}{
		{"/mcp", "", `Bearer realm="vm-manager", ` + mcp, 401},
		{"/mcp/sub", "", `Bearer realm="vm-manager", ` + mcp, 401},
		{"/mcpx", "", `Bearer realm="vm-manager", ` + root, 401},
		{"/api/v1/host", "", `Bearer realm="vm-manager", ` + root, 401},
		{"/nowhere", "", `Bearer realm="vm-manager", ` + root, 401},
		{"/mcp", "Bearer not.a.jwt", `Bearer realm="vm-manager", ` + mcp + `, error="invalid_token", error_description="malformed token"`, 401},
		{"/api/v1/host", "Basic dTpw", `Bearer realm="vm-manager", ` + root + `, error="invalid_token", error_description="authorization is not a bearer token"`, 401},
		{"/backend-refuses", good, `Bearer realm="vm-manager", ` + root + `, error="invalid_token"`, 401},
		{"/backend-challenges", good, `Bearer realm="other"`, 401},
		{"/stream", good, "", 200},
		{"/healthz", "", "", 200},
	} {
		h := http.Header{}
		if tc.auth != "" {
			h.Set("Authorization", tc.auth)
		}
		resp, body := send(t, "GET", srv.URL+tc.path, h)
		if resp.StatusCode != tc.status || resp.Header.Get("WWW-Authenticate") != tc.want {
			t.Errorf("GET %s (%.12q…): %d %q\nwant %d %q", tc.path, tc.auth, resp.StatusCode, resp.Header.Get("WWW-Authenticate"), tc.status, tc.want)
		}
		if tc.path == "/stream" && body != "data: 1\n\n" {
			t.Errorf("stream body %q", body)
		}
	}
}

// TestResourceOpensNothingElse: the metadata is served without a token, and
// nothing beside it is: not a longer path, not another method, not an
// unclean path that would lead elsewhere.
func TestResourceOpensNothingElse(t *testing.T) {
	p := oidctest.Start(t)
	srv, reached := resourceServer(t, newVerifier(t, p), identity.ResourceConfig{}, nil)
	for _, r := range [][2]string{
		{"GET", identity.MetadataPath + "/api/v1/host"},
		{"GET", identity.MetadataPath + "x"},
		{"GET", identity.MetadataPath + "/"},
		{"GET", identity.MetadataPath + "/mcp/"},
		{"GET", identity.MetadataPath + "/mcp/x"},
		{"GET", identity.MetadataPath + "/mcpx"},
		{"GET", identity.MetadataPath + "/../api/v1/host"},
		{"POST", identity.MetadataPath},
		{"PUT", identity.MetadataPath + "/mcp"},
		{"DELETE", identity.MetadataPath},
		{"POST", "/mcp"},
	} {
		req, _ := http.NewRequest(r[0], srv.URL, nil)
		req.URL.Opaque = r[1] // as sent, uncleaned by the client
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("%s %s without a token: %d, want 401", r[0], r[1], resp.StatusCode)
		}
	}
	if n := reached.Load(); n != 0 {
		t.Errorf("%d requests without a token reached the guarded handler", n)
	}
}

// TestAnonymousResource: without an issuer there is no metadata (the
// request goes on to the mux, which has no such route) and no challenge.
func TestAnonymousResource(t *testing.T) {
	srv, reached := resourceServer(t, nil, identity.ResourceConfig{PublicURL: "https://vmm.corp.test"}, http.NotFound)
	if resp, _ := send(t, "GET", srv.URL+identity.MetadataPath+"/mcp", nil); resp.StatusCode != 404 || resp.Header.Get("WWW-Authenticate") != "" || reached.Load() != 1 {
		t.Errorf("anonymous metadata: %d %q, reached %d", resp.StatusCode, resp.Header.Get("WWW-Authenticate"), reached.Load())
	}
}

func TestResourceConfigRefused(t *testing.T) {
	for _, tc := range []struct {
		cfg  identity.ResourceConfig
		want string
	}{
		{identity.ResourceConfig{PublicURL: "http://vmm.corp.test"}, "http only on loopback"},
		{identity.ResourceConfig{PublicURL: "ftp://vmm.corp.test"}, "scheme must be https"},
		{identity.ResourceConfig{PublicURL: "vmm.corp.test:8080"}, "scheme must be https"},
		{identity.ResourceConfig{PublicURL: "https://"}, "no host"},
		{identity.ResourceConfig{PublicURL: "https:vmm"}, "no host"},
		{identity.ResourceConfig{PublicURL: "https://u:p@vmm.corp.test"}, "credentials"},
		{identity.ResourceConfig{PublicURL: "https://vmm.corp.test/?a=b"}, "a query"},
		{identity.ResourceConfig{PublicURL: "https://vmm.corp.test/#x"}, "a fragment"},
		{identity.ResourceConfig{PublicURL: "https://vmm.corp.test/a/../b"}, "path must be clean"},
		{identity.ResourceConfig{PublicURL: "https://vmm.corp.test//a"}, "path must be clean"},
		{identity.ResourceConfig{PublicURL: "https://vmm corp"}, "public URL"},
		{identity.ResourceConfig{Scopes: []string{"openid email"}}, "oidc scope"},
		{identity.ResourceConfig{Scopes: []string{`a"b`}}, "oidc scope"},
	} {
		if _, err := identity.NewResource(nil, tc.cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: err = %v, want it to say %q", tc.cfg, err, tc.want)
		}
	}
	for _, ok := range []string{"https://vmm.corp.test", "https://vmm.corp.test:8443/prefix/", "http://127.0.0.1:8080", "http://localhost:9000", "http://[::1]:8080"} {
		if _, err := identity.NewResource(nil, identity.ResourceConfig{PublicURL: ok}); err != nil {
			t.Errorf("%s: %v", ok, err)
		}
	}
}
