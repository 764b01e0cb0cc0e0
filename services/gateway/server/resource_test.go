package server

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/identity/oidctest"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
)

// refusingHypervisor refuses every token, as a backend does whose JWKS is
// behind the gateway's.
type refusingHypervisor struct {
	hypervisorv1.UnimplementedHypervisorServiceServer
}

func (refusingHypervisor) GetHost(context.Context, *hypervisorv1.GetHostRequest) (*hypervisorv1.Host, error) {
	return nil, apierr.ToStatus(apierr.Errorf(apierr.Unauthenticated, "token signature invalid")).Err()
}

func get(t *testing.T, method, url, host, auth string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, nil)
	if host != "" {
		req.Host = host
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	if method == "POST" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// TestEvery401NamesTheMetadata: with an issuer, the gateway's 401s (its
// own, on REST, MCP and paths nothing serves, and REST's when a backend
// refuses a token the gateway accepted) point at the protected resource
// metadata, which names the issuer.
func TestEvery401NamesTheMetadata(t *testing.T) {
	op := oidctest.Start(t)
	dir := t.TempDir()
	ln, err := net.Listen("unix", dir+"/hypervisor.sock")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	hypervisorv1.RegisterHypervisorServiceServer(gs, refusingHypervisor{})
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)
	addr, cancel, done := startGateway(t, dir, func(c *Config) {
		c.Identity = identity.Config{Issuer: op.Issuer(), Audiences: []string{op.Audience}}
		c.Resource = identity.ResourceConfig{Scopes: []string{"openid", "email"}}
	})
	t.Cleanup(func() { cancel(); <-done })
	base := "http://" + addr
	good := "Bearer " + op.Token(oidctest.Claims{})

	root := `Bearer realm="vm-manager", resource_metadata="` + base + `/.well-known/oauth-protected-resource"`
	mcp := `Bearer realm="vm-manager", resource_metadata="` + base + `/.well-known/oauth-protected-resource/mcp"`
	for _, tc := range []struct{ method, path, auth, want string }{
		{"GET", "/api/v1/host", "", root},
		{"GET", "/api/v1/host", good, root + `, error="invalid_token"`}, // the hypervisor refused it
		{"GET", "/api/v1/networks", "Bearer x", root + `, error="invalid_token", error_description="malformed token"`},
		{"GET", "/nowhere", "", root},
		{"POST", "/mcp", "", mcp},
		{"GET", "/mcp", "", mcp},
		{"POST", "/.well-known/oauth-protected-resource", "", root},
	} {
		resp, body := get(t, tc.method, base+tc.path, "", tc.auth)
		var env struct{ Error struct{ Code string } }
		if resp.StatusCode != 401 || resp.Header.Get("WWW-Authenticate") != tc.want || json.Unmarshal([]byte(body), &env) != nil || env.Error.Code != "unauthenticated" {
			t.Errorf("%s %s (%.12q…): %d %q %s\nwant 401 %q", tc.method, tc.path, tc.auth, resp.StatusCode, resp.Header.Get("WWW-Authenticate"), body, tc.want)
		}
	}

	// The metadata: the resource as the client named it (its Host; a
	// reverse proxy's name needs --public-url only for https).
	for path, want := range map[string]string{
		"/.well-known/oauth-protected-resource":     `{"resource":"http://vmm.corp.test:8080","authorization_servers":["` + op.Issuer() + `"],"bearer_methods_supported":["header"],"scopes_supported":["openid","email"],"resource_name":"vm-manager"}`,
		"/.well-known/oauth-protected-resource/mcp": `{"resource":"http://vmm.corp.test:8080/mcp","authorization_servers":["` + op.Issuer() + `"],"bearer_methods_supported":["header"],"scopes_supported":["openid","email"],"resource_name":"vm-manager"}`,
	} {
		resp, body := get(t, "GET", base+path, "vmm.corp.test:8080", "")
		if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" || strings.TrimSpace(body) != want {
			t.Errorf("GET %s: %d %q %s\nwant %s", path, resp.StatusCode, resp.Header.Get("Content-Type"), body, want)
		}
	}
}

// TestAnonymousHasNoMetadata: without an issuer there is nothing to
// discover: 404 not_found, as for any path nothing serves.
func TestAnonymousHasNoMetadata(t *testing.T) {
	addr, cancel, done := startGateway(t, t.TempDir(), func(c *Config) {
		c.Resource = identity.ResourceConfig{PublicURL: "https://vmm.corp.test"}
	})
	t.Cleanup(func() { cancel(); <-done })
	for _, path := range []string{"/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp"} {
		resp, body := get(t, "GET", "http://"+addr+path, "", "")
		var env struct{ Error struct{ Code string } }
		if resp.StatusCode != 404 || json.Unmarshal([]byte(body), &env) != nil || env.Error.Code != "not_found" || resp.Header.Get("WWW-Authenticate") != "" {
			t.Errorf("GET %s: %d %q %s", path, resp.StatusCode, resp.Header.Get("WWW-Authenticate"), body)
		}
	}
}

func TestPublicURLRefused(t *testing.T) {
	err := Run(context.Background(), Config{Listen: "127.0.0.1:0", Resource: identity.ResourceConfig{PublicURL: "http://vmm.corp.test"}}, slog.New(slog.DiscardHandler))
	if err == nil || !strings.Contains(err.Error(), "http only on loopback") {
		t.Errorf("Run with an http public URL: %v", err)
	}
}
