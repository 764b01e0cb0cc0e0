package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/pkg/identity/oidctest"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/modelcontextprotocol/go-sdk/oauthex"
)

// TestMCPClientLogsIn: an MCP client that knows nothing but the gateway's
// /mcp URL and its own client id at the issuer logs in by itself, as the
// MCP authorization spec has it: its first request is refused 401, the
// challenge names the protected resource metadata, the metadata names the
// issuer, the issuer's discovery gives the endpoints, the authorization code
// flow with PKCE gives a token, and the retried request, then tool calls,
// succeed as the user the issuer signed in. The MCP SDK's own OAuth client
// (auth.AuthorizationCodeHandler) against the in-process OpenID Provider;
// in-process with the public URL derived from the request, and as the three
// binaries with --public-url.
func TestMCPClientLogsIn(t *testing.T) {
	for _, mode := range []cluster.Mode{cluster.InProcess, cluster.Processes} {
		t.Run(string(mode), func(t *testing.T) {
			op := oidctest.Start(t)
			browser := newLoopbackRedirect(t)
			op.AddClient("mcp-cli", browser.url)
			op.SetUser(oidctest.Claims{Subject: "u-9", Email: "grace@example.com"})
			opts := cluster.Options{
				OIDCIssuer: op.Issuer(),
				// The tokens the issuer gives the MCP client are its own
				// (aud: its client id), as Dex's are.
				OIDCAudiences: []string{"mcp-cli"},
				OIDCScopes:    []string{"openid", "email"},
			}
			c := cluster.Start(t, mode, binDir, opts)
			endpoint := "http://" + c.Addr + "/mcp"
			if mode == cluster.Processes {
				// The name clients use is what --public-url says, not
				// what the gateway would derive from the request.
				_, port, _ := net.SplitHostPort(c.Addr)
				public := "http://localhost:" + port
				c.StopService("gateway")
				c.SetEnv("VM_MANAGER_PUBLIC_URL=" + public)
				c.StartService("gateway")
				c.WaitReady(30 * time.Second)
				endpoint = public + "/mcp"
				// A client that reaches the gateway by another name is
				// told the configured one.
				_, hdr, _ := cluster.DoContext(context.Background(), t, "GET", "http://"+c.Addr+"/api/v1/host", "", nil)
				if want := `Bearer realm="vm-manager", resource_metadata="` + public + `/.well-known/oauth-protected-resource"`; hdr.Get("WWW-Authenticate") != want {
					t.Errorf("GET /api/v1/host at %s: WWW-Authenticate %q, want %q", c.Addr, hdr.Get("WWW-Authenticate"), want)
				}
			}
			mcpLogin(t, op, browser, endpoint)
		})
	}
}

func mcpLogin(t *testing.T, op *oidctest.Provider, browser *loopbackRedirect, endpoint string) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	base := strings.TrimSuffix(endpoint, "/mcp")

	// What the client meets first, seen raw.
	code, hdr, _ := cluster.DoContext(ctx, t, "POST", endpoint, `{"jsonrpc":"2.0","id":1,"method":"ping"}`, nil)
	want := `Bearer realm="vm-manager", resource_metadata="` + base + `/.well-known/oauth-protected-resource/mcp"`
	if code != http.StatusUnauthorized || hdr.Get("WWW-Authenticate") != want {
		t.Fatalf("POST /mcp without a token: %d %q, want 401 %q", code, hdr.Get("WWW-Authenticate"), want)
	}

	var (
		mu       sync.Mutex
		authURLs []string
	)
	handler, err := auth.NewAuthorizationCodeHandler(&auth.AuthorizationCodeHandlerConfig{
		PreregisteredClient: &oauthex.ClientCredentials{ClientID: "mcp-cli"},
		RedirectURL:         browser.url,
		// The user's browser: it opens the authorization URL, the issuer
		// signs the user in and redirects to the client's loopback
		// listener, which hands the code over.
		AuthorizationCodeFetcher: func(ctx context.Context, args *auth.AuthorizationArgs) (*auth.AuthorizationResult, error) {
			mu.Lock()
			authURLs = append(authURLs, args.URL)
			mu.Unlock()
			return browser.open(ctx, args.URL)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "oauth-client", Version: "v0"}, nil).Connect(ctx, &mcp.StreamableClientTransport{
		Endpoint:     endpoint,
		OAuthHandler: handler,
	}, nil)
	if err != nil {
		t.Fatalf("connect with OAuth: %v", err)
	}
	defer cs.Close()
	t.Logf("logged in and initialized in %s", time.Since(start).Round(time.Millisecond))

	// The 401 led the client to the issuer, once, for this resource.
	mu.Lock()
	if len(authURLs) != 1 || !strings.HasPrefix(authURLs[0], op.Issuer()+"/authorize?") {
		t.Errorf("authorization URLs %q, want one at %s/authorize", authURLs, op.Issuer())
	}
	mu.Unlock()
	// The scopes are the metadata's scopes_supported, in any order.
	grants := op.Grants()
	if len(grants) != 1 || grants[0].ClientID != "mcp-cli" || grants[0].Resource != endpoint || !slices.Equal(slices.Sorted(slices.Values(strings.Fields(grants[0].Scope))), []string{"email", "openid"}) {
		t.Errorf("grants %+v, want one for mcp-cli, resource %s, scopes email and openid", grants, endpoint)
	}

	// The session works as the user the issuer signed in.
	tools, err := cs.ListTools(ctx, nil)
	if err != nil || len(tools.Tools) == 0 {
		t.Fatalf("tools/list: %v", err)
	}
	out := callTool(t, cs, "create_network", map[string]any{"name": "oauthnet", "cidr": "10.79.0.0/24"}, false)
	var nw struct {
		CreatedBy string `json:"createdBy"`
	}
	if err := json.Unmarshal([]byte(out), &nw); err != nil || nw.CreatedBy != "grace@example.com" {
		t.Errorf("create_network: createdBy %q (%v): %s", nw.CreatedBy, err, out)
	}
	callTool(t, cs, "delete_network", map[string]any{"name": "oauthnet"}, false)
	if n := len(op.Grants()); n != 1 {
		t.Errorf("%d grants after the session's calls, want the one login", n)
	}
}

// loopbackRedirect is a native client's redirect listener on loopback
// (RFC 8252 §7.3) together with the browser that ends up there.
type loopbackRedirect struct {
	url  string
	srv  *httptest.Server
	mu   sync.Mutex
	last url.Values
}

func newLoopbackRedirect(t *testing.T) *loopbackRedirect {
	b := &loopbackRedirect{}
	b.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.mu.Lock()
		b.last = r.URL.Query()
		b.mu.Unlock()
		_, _ = io.WriteString(w, "signed in; this window can be closed\n")
	}))
	t.Cleanup(b.srv.Close)
	b.url = b.srv.URL + "/callback"
	return b
}

// open follows the authorization URL through the issuer's redirect to the
// listener and returns what the listener received.
func (b *loopbackRedirect) open(ctx context.Context, authURL string) (*auth.AuthorizationResult, error) {
	req, err := http.NewRequestWithContext(ctx, "GET", authURL, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	resp.Body.Close()
	b.mu.Lock()
	q := b.last
	b.mu.Unlock()
	if resp.StatusCode != http.StatusOK || q == nil || q.Get("code") == "" {
		return nil, fmt.Errorf("authorization: %d, redirect %v", resp.StatusCode, q)
	}
	return &auth.AuthorizationResult{Code: q.Get("code"), State: q.Get("state"), Iss: q.Get("iss")}, nil
}
