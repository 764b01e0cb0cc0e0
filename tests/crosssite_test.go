package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// browserRequest is what a page in the operator's browser can make the
// browser send to the gateway: the Host the page's URL names, the Origin the
// browser adds, and a "simple" Content-Type that needs no CORS preflight.
type browserRequest struct {
	name, method, path string
	host               string // "" is the gateway's own address
	origin             string
	contentType        string
	body               string
}

// send sends r to addr exactly as a browser would address it (the
// connection goes to addr, the Host header says r.host).
func (r browserRequest) send(t *testing.T, addr string) (int, http.Header, []byte) {
	t.Helper()
	req, err := http.NewRequest(r.method, "http://"+addr+r.path, strings.NewReader(r.body))
	if err != nil {
		t.Fatal(err)
	}
	if r.host != "" {
		req.Host = r.host
	}
	if r.origin != "" {
		req.Header.Set("Origin", r.origin)
	}
	if r.contentType != "" {
		req.Header.Set("Content-Type", r.contentType)
	}
	if r.path == "/mcp" {
		req.Header.Set("Accept", "application/json, text/event-stream")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s: %v", r.name, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, b
}

func refusedSeries(surface, reason string) string {
	return fmt.Sprintf(`vm_manager_requests_refused_total{reason=%q,surface=%q}`, reason, surface)
}

// TestCrossSite attacks the anonymous gateway the way a web page the
// operator opens can: cross-site "simple" requests (text/plain, forms, no
// preflight) and DNS rebinding (the page's own name resolving to the
// gateway, so the page is same-origin and could read the answers and send
// JSON). Every one is refused with the REST envelope, counted in
// vm_manager_requests_refused_total, and creates nothing; the clients that
// are meant to work (REST with JSON, bodyless actions, the gRPC SDK, the MCP
// SDK, an --allowed-hosts name) still do. No VM boots.
func TestCrossSite(t *testing.T) {
	for _, mode := range []cluster.Mode{cluster.InProcess, cluster.Processes} {
		t.Run(string(mode), func(t *testing.T) {
			images := t.TempDir()
			writeCatalog(t, images)
			c := cluster.Start(t, mode, binDir, cluster.Options{ImageDir: images, AllowedHosts: []string{"vmm.test"}})
			crossSiteChecks(t, c)
		})
	}
}

func crossSiteChecks(t *testing.T, c *cluster.Cluster) {
	_, port, _ := net.SplitHostPort(c.Addr)
	rebound := "rebind.attacker.test:" + port // the page's name, resolving to 127.0.0.1 after rebinding
	create := `{"name":"xsite","cidr":"10.77.0.0/24"}`
	initialize := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"page","version":"0"}}}`
	attacks := []struct {
		req          browserRequest
		status       int
		code, reason string
		surface      string
	}{
		// The report's request: answered 201 and created the network.
		{browserRequest{"the report's curl", "POST", "/api/v1/networks", "evil.example", "http://evil.example", "text/plain", create}, 403, "forbidden", "host", "rest"},
		// DNS rebinding: same-origin for the browser, so JSON and readable
		// answers; only the Host names the attacker.
		{browserRequest{"rebinding: create", "POST", "/api/v1/networks", rebound, "http://" + rebound, "application/json", create}, 403, "forbidden", "host", "rest"},
		{browserRequest{"rebinding: read", "GET", "/api/v1/vms", rebound, "", "", ""}, 403, "forbidden", "host", "rest"},
		{browserRequest{"rebinding: exec", "POST", "/api/v1/vms/0a1b2c3d/exec", rebound, "http://" + rebound, "application/json", `{"command":["id"]}`}, 403, "forbidden", "host", "rest"},
		{browserRequest{"rebinding: read the host report", "GET", "/api/v1/host", rebound, "", "", ""}, 403, "forbidden", "host", "rest"},
		{browserRequest{"rebinding: MCP", "POST", "/mcp", rebound, "http://" + rebound, "application/json", initialize}, 403, "forbidden", "host", "mcp"},
		// Cross-site pages: the gateway's own address, the page's Origin.
		{browserRequest{"cross-site fetch, no-cors text/plain", "POST", "/api/v1/networks", "", "http://evil.example", "text/plain;charset=UTF-8", create}, 403, "forbidden", "origin", "rest"},
		{browserRequest{"cross-site form", "POST", "/api/v1/networks", "", "https://evil.example", "application/x-www-form-urlencoded", create}, 403, "forbidden", "origin", "rest"},
		{browserRequest{"cross-site form to an action", "POST", "/api/v1/vms/0a1b2c3d/stop", "", "http://evil.example", "application/x-www-form-urlencoded", ""}, 403, "forbidden", "origin", "rest"},
		{browserRequest{"sandboxed frame (Origin null)", "POST", "/api/v1/networks", "", "null", "text/plain", create}, 403, "forbidden", "origin", "rest"},
		{browserRequest{"another local port's page", "POST", "/api/v1/networks", "", "http://localhost:3000", "text/plain", create}, 403, "forbidden", "origin", "rest"},
		{browserRequest{"cross-site MCP", "POST", "/mcp", "", "http://evil.example", "text/plain", initialize}, 403, "forbidden", "origin", "mcp"},
		// Without an Origin (a client that hides it), the body type alone.
		{browserRequest{"text/plain body", "POST", "/api/v1/networks", "", "", "text/plain", create}, 415, "invalid_request", "content_type", "rest"},
		{browserRequest{"form body (curl -d)", "POST", "/api/v1/networks", "", "", "application/x-www-form-urlencoded", create}, 415, "invalid_request", "content_type", "rest"},
		{browserRequest{"no Content-Type", "POST", "/api/v1/networks", "", "", "", create}, 415, "invalid_request", "content_type", "rest"},
		{browserRequest{"PUT policy as a form", "PUT", "/api/v1/images/giantswarm-vm-base_0.2.0/policy", "", "", "application/x-www-form-urlencoded", `{}`}, 415, "invalid_request", "content_type", "rest"},
		{browserRequest{"MCP as text/plain", "POST", "/mcp", "", "", "text/plain", initialize}, 415, "invalid_request", "content_type", "mcp"},
	}

	before := scrapeMetrics(t, c.Addr)
	want := map[string]float64{}
	for _, a := range attacks {
		code, hdr, b := a.req.send(t, c.Addr)
		var e envelope
		if code != a.status || hdr.Get("Content-Type") != "application/json" || json.Unmarshal(b, &e) != nil || e.Error.Code != a.code {
			t.Errorf("%s: %d %q %s; want %d with the %s envelope", a.req.name, code, hdr.Get("Content-Type"), b, a.status, a.code)
			continue
		}
		t.Logf("%s: %d %s", a.req.name, code, e.Error.Message)
		want[refusedSeries(a.surface, a.reason)]++
	}
	after := scrapeMetrics(t, c.Addr)
	for _, s := range []string{"rest", "mcp"} {
		for _, r := range []string{"content_type", "host", "origin"} {
			series := refusedSeries(s, r)
			if got := seriesValue(after, series) - seriesValue(before, series); got != want[series] {
				t.Errorf("%s rose by %v, want %v", series, got, want[series])
			}
		}
	}
	// Nothing was created, and the gateway still answers.
	if code, _, b := cluster.Do(t, "GET", "http://"+c.Addr+"/api/v1/networks/xsite", ""); code != http.StatusNotFound {
		t.Errorf("a refused create left network xsite behind: %d %s", code, b)
	}
	if err := cluster.Readyz(c.Addr); err != nil {
		t.Errorf("readyz: %v", err)
	}

	t.Run("legitimate clients", func(t *testing.T) {
		api := "http://" + c.Addr + "/api/v1"
		if code, _, b := cluster.Do(t, "POST", api+"/networks", create); code != http.StatusCreated {
			t.Fatalf("REST create with JSON: %d %s", code, b)
		}
		if code, _, b := cluster.Do(t, "DELETE", api+"/networks/xsite", ""); code != http.StatusNoContent {
			t.Errorf("REST delete: %d %s", code, b)
		}
		for _, r := range []browserRequest{
			{"JSON with a charset, Origin of the gateway's own page", "POST", "/api/v1/networks", "", "http://" + c.Addr, "application/json; charset=utf-8", create},
			{"localhost", "GET", "/api/v1/networks/xsite", "localhost:" + port, "", "", ""},
			{"an --allowed-hosts name, any port, from its https page", "GET", "/api/v1/networks/xsite", "vmm.test", "https://vmm.test", "", ""},
			{"a bodyless action", "POST", "/api/v1/vms/0a1b2c3d/start", "", "", "", ""},
			{"a probe with any Host", "GET", "/healthz", "evil.example", "", "", ""},
			{"the OpenAPI document with any Host", "GET", "/api/v1/openapi.json", "evil.example", "", "", ""},
			{"delete", "DELETE", "/api/v1/networks/xsite", "", "", "", ""},
		} {
			code, _, b := r.send(t, c.Addr)
			switch {
			case r.path == "/api/v1/vms/0a1b2c3d/start" && code == http.StatusNotFound: // reached the hypervisor
			case code < 300:
			default:
				t.Errorf("%s: %d %s", r.name, code, b)
			}
		}

		// The gRPC SDK: not an HTTP/1 surface a page can reach.
		conn, err := grpc.NewClient(c.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := hypervisorv1.NewHypervisorServiceClient(conn).ListNetworks(ctx, &hypervisorv1.ListNetworksRequest{}); err != nil {
			t.Errorf("gRPC ListNetworks: %v", err)
		}

		// The MCP SDK's client (a session, its SSE stream, a tool call).
		cs, err := mcp.NewClient(&mcp.Implementation{Name: "xsite", Version: "0"}, nil).Connect(ctx, &mcp.StreamableClientTransport{Endpoint: "http://" + c.Addr + "/mcp"}, nil)
		if err != nil {
			t.Fatalf("MCP connect: %v", err)
		}
		defer cs.Close()
		if out := callTool(t, cs, "list_networks", nil, false); !strings.Contains(out, `"default"`) {
			t.Errorf("MCP list_networks: %s", out)
		}
	})
}
