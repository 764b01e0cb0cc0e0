package tests

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/identity/oidctest"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/tests/cluster"
	jose "github.com/go-jose/go-jose/v4"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// TestIdentity runs the three services against an in-process OpenID Provider
// (a real issuer over HTTP with a JWKS) and checks that REST, gRPC through the
// gateway and the backends' own sockets refuse every bad token, accept a good
// one, and record the caller. No VM boots.
func TestIdentity(t *testing.T) {
	for _, mode := range []cluster.Mode{cluster.InProcess, cluster.Processes} {
		t.Run(string(mode), func(t *testing.T) {
			op := oidctest.Start(t)
			images := t.TempDir()
			writeCatalog(t, images)
			c := cluster.Start(t, mode, binDir, cluster.Options{
				ImageDir:      images,
				OIDCIssuer:    op.Issuer(),
				OIDCAudiences: []string{"portal", op.Audience},
				// Keys expire after a second, and each process fetches
				// the JWKS at most once a second.
				OIDCJWKSRefreshInterval: time.Second,
			})
			identityChecks(t, c, op)
		})
	}
}

// authDo sends a request with an optional Authorization header.
func authDo(t *testing.T, method, url, auth, body string) (int, http.Header, []byte) {
	t.Helper()
	var header http.Header
	if auth != "" {
		header = http.Header{"Authorization": {auth}}
	}
	return cluster.DoContext(context.Background(), t, method, url, body, header)
}

func identityChecks(t *testing.T, c *cluster.Cluster, op *oidctest.Provider) {
	base := "http://" + c.Addr
	api := base + "/api/v1"
	ctx, cancel := context.WithTimeout(context.Background(), 45*time.Second)
	defer cancel()

	stranger, err := oidctest.NewKey(jose.RS256)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	bad := []struct {
		name, token, reason string
	}{
		{"missing", "", "missing bearer token"},
		{"malformed", "not.a.jwt", "malformed token"},
		{"expired", op.Token(oidctest.Claims{Expiry: now.Add(-time.Hour), IssuedAt: now.Add(-2 * time.Hour)}), "token expired"},
		{"wrong issuer", op.Token(oidctest.Claims{Issuer: "https://issuer.invalid"}), "token issuer not trusted"},
		{"wrong audience", op.Token(oidctest.Claims{Audience: []string{"someone-else"}}), "token audience not trusted"},
		{"wrong signature", op.TokenWith(stranger, oidctest.Claims{}), "token signature invalid"},
		{"alg none", op.Unsigned(oidctest.Claims{}), "token signature algorithm not supported"},
	}
	good := op.Token(oidctest.Claims{Subject: "u-1", Email: "ada@example.com", Name: "Ada", Groups: []string{"ops"}})
	bearer := func(tok string) string {
		if tok == "" {
			return ""
		}
		return "Bearer " + tok
	}

	t.Run("open paths need no token", func(t *testing.T) {
		for _, p := range []string{"/healthz", "/readyz", "/metrics", "/api/v1/openapi.json", "/api/v1/openapi.yaml", "/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp"} {
			if code, _, b := authDo(t, "GET", base+p, "", ""); code != http.StatusOK {
				t.Errorf("GET %s without token: %d %s", p, code, b)
			}
		}
	})

	t.Run("REST refuses bad tokens", func(t *testing.T) {
		for _, tc := range bad {
			for _, req := range [][3]string{{"GET", api + "/host", ""}, {"GET", api + "/networks", ""}, {"POST", api + "/networks", `{"name":"nope","cidr":"10.9.0.0/24"}`}, {"GET", api + "/attestation", ""}, {"GET", api + "/vms:watch", ""}} {
				code, hdr, b := authDo(t, req[0], req[1], bearer(tc.token), req[2])
				if code != http.StatusUnauthorized {
					t.Errorf("%s: %s %s: status %d, want 401: %s", tc.name, req[0], req[1], code, b)
					continue
				}
				if wa := hdr.Get("WWW-Authenticate"); !strings.HasPrefix(wa, `Bearer realm="vm-manager"`) || (tc.token != "") != strings.Contains(wa, `error="invalid_token"`) {
					t.Errorf("%s: WWW-Authenticate %q", tc.name, wa)
				}
				if ct := hdr.Get("Content-Type"); ct != "application/json" {
					t.Errorf("%s: content-type %q", tc.name, ct)
				}
				var e envelope
				dec := json.NewDecoder(bytes.NewReader(b))
				dec.DisallowUnknownFields()
				if err := dec.Decode(&e); err != nil || e.Error.Code != string(apierr.Unauthenticated) || e.Error.Message != tc.reason {
					t.Errorf("%s: body %s (%v), want unauthenticated / %q", tc.name, b, err, tc.reason)
				}
			}
		}
		// Nothing was created by the refused POSTs.
		if code, _, _ := authDo(t, "GET", api+"/networks/nope", bearer(good), ""); code != http.StatusNotFound {
			t.Errorf("a refused create left a network behind: GET status %d", code)
		}
		// Unknown paths are behind the guard too.
		if code, _, _ := authDo(t, "GET", base+"/nowhere", "", ""); code != http.StatusUnauthorized {
			t.Errorf("GET /nowhere without token: %d, want 401", code)
		}
	})

	t.Run("REST with a good token", func(t *testing.T) {
		if code, _, b := authDo(t, "GET", api+"/host", bearer(good), ""); code != http.StatusOK {
			t.Fatalf("GET /host: %d %s", code, b)
		}
		if code, _, b := authDo(t, "GET", api+"/networks", bearer(good), ""); code != http.StatusOK {
			t.Fatalf("GET /networks: %d %s", code, b)
		}
		// The watch's stream, whose handler forwards the token itself.
		wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
		wreq, _ := http.NewRequestWithContext(wctx, "GET", api+"/vms:watch", nil)
		wreq.Header.Set("Authorization", bearer(good))
		if resp, err := http.DefaultClient.Do(wreq); err != nil {
			t.Errorf("GET /vms:watch: %v", err)
		} else {
			line, _ := bufio.NewReader(resp.Body).ReadString('\n')
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK || !strings.HasPrefix(line, `{"result":{"type":"synced"`) {
				t.Errorf("GET /vms:watch with a good token: %d %s", resp.StatusCode, line)
			}
		}
		wcancel()
		// A second trusted audience and an ES256 key work too.
		if _, err := op.Rotate(jose.ES256); err != nil {
			t.Fatal(err)
		}
		portal := op.Token(oidctest.Claims{Subject: "u-2", Audience: []string{"portal"}})
		// The bad signatures above made the gateway fetch the JWKS just
		// now: the new key is fetched within the minimum interval (here a
		// second), not necessarily at once.
		cluster.Eventually(t, 10*time.Second, "the rotated key", func() error {
			if code, _, b := authDo(t, "GET", api+"/host", bearer(portal), ""); code != http.StatusOK {
				return fmt.Errorf("GET /host with the portal's ES256 token after a key rotation: %d %s", code, b)
			}
			return nil
		})
		// A client cannot smuggle a second authorization past the one verified
		// (grpc-gateway's default header matcher forwards no Grpc-Metadata-*;
		// were it to, the backend would refuse two authorization values).
		req, _ := http.NewRequest("GET", api+"/host", nil)
		req.Header.Set("Authorization", bearer(good))
		req.Header.Set("Grpc-Metadata-Authorization", "Bearer forged")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("GET /host with Grpc-Metadata-Authorization added: %d, want 200 (the header is not forwarded)", resp.StatusCode)
		}
	})

	t.Run("the caller is recorded on a network", func(t *testing.T) {
		code, _, b := authDo(t, "POST", api+"/networks", bearer(good), `{"name":"ident","cidr":"10.77.0.0/24"}`)
		if code != http.StatusCreated {
			t.Fatalf("POST /networks: %d %s", code, b)
		}
		var nw struct {
			CreatedBy string `json:"createdBy"`
		}
		code, _, b = authDo(t, "GET", api+"/networks/ident", bearer(good), "")
		if code != http.StatusOK {
			t.Fatalf("GET /networks/ident: %d %s", code, b)
		}
		if err := json.Unmarshal(b, &nw); err != nil || nw.CreatedBy != "ada@example.com" {
			t.Errorf("createdBy = %q (%v), want ada@example.com: %s", nw.CreatedBy, err, b)
		}
		if code, _, b := authDo(t, "DELETE", api+"/networks/ident", bearer(good), ""); code != http.StatusNoContent {
			t.Errorf("DELETE /networks/ident: %d %s", code, b)
		}
	})

	t.Run("the catalog policy syncs and golden changes record the caller", func(t *testing.T) {
		// The hypervisor hands the catalog's policy over on the internal
		// VerifierService, with no person's token.
		cluster.Eventually(t, 20*time.Second, "policy sync", func() error {
			code, _, b := authDo(t, "GET", api+"/images/giantswarm-vm-base_0.2.0/policy", bearer(good), "")
			if code != http.StatusOK {
				return fmt.Errorf("%d %s", code, b)
			}
			return nil
		})
		code, _, b := authDo(t, "DELETE", api+"/images/giantswarm-vm-base_0.2.0/policy/golden", bearer(good), "")
		if code != http.StatusNoContent && code != http.StatusOK {
			t.Fatalf("DELETE golden: %d %s", code, b)
		}
		var pol struct {
			GoldenUpdatedBy string `json:"goldenUpdatedBy"`
		}
		_, _, b = authDo(t, "GET", api+"/images/giantswarm-vm-base_0.2.0/policy", bearer(good), "")
		if err := json.Unmarshal(b, &pol); err != nil || pol.GoldenUpdatedBy != "ada@example.com" {
			t.Errorf("goldenUpdatedBy = %q (%v), want ada@example.com: %s", pol.GoldenUpdatedBy, err, b)
		}
	})

	t.Run("MCP", func(t *testing.T) {
		initialize := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"t","version":"0"}}}`
		for _, tc := range bad {
			code, hdr, b := authDo(t, "POST", base+"/mcp", bearer(tc.token), initialize)
			if code != http.StatusUnauthorized || !strings.HasPrefix(hdr.Get("WWW-Authenticate"), `Bearer realm="vm-manager"`) || !strings.Contains(string(b), tc.reason) {
				t.Errorf("%s: POST /mcp: %d %v %s", tc.name, code, hdr.Get("WWW-Authenticate"), b)
			}
		}
		cs := mcpSession(t, c.Addr, good, nil)
		if out := callTool(t, cs, "create_network", map[string]any{"name": "viamcp", "cidr": "10.78.0.0/24"}, false); !strings.Contains(out, `"createdBy": "ada@example.com"`) {
			t.Errorf("create_network over MCP: %s", out)
		}
		callTool(t, cs, "delete_network", map[string]any{"name": "viamcp"}, false)
	})

	t.Run("gRPC through the gateway", func(t *testing.T) {
		conn, err := grpc.NewClient(c.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		hv := hypervisorv1.NewHypervisorServiceClient(conn)
		at := attestationv1.NewAttestationServiceClient(conn)
		for _, tc := range bad {
			cctx := ctx
			if tc.token != "" {
				cctx = metadata.AppendToOutgoingContext(ctx, "authorization", bearer(tc.token))
			}
			_, err := hv.ListNetworks(cctx, &hypervisorv1.ListNetworksRequest{})
			if status.Code(err) != codes.Unauthenticated || apierr.CodeOf(err) != apierr.Unauthenticated || apierr.MessageOf(err) != tc.reason {
				t.Errorf("%s: ListNetworks: err = %v, want Unauthenticated %q", tc.name, err, tc.reason)
			}
			if _, err := at.GetAttestationStatus(cctx, &attestationv1.GetAttestationStatusRequest{}); status.Code(err) != codes.Unauthenticated {
				t.Errorf("%s: GetAttestationStatus: err = %v, want Unauthenticated", tc.name, err)
			}
			// A stream is checked like a call: the watch's first Recv.
			if _, err := firstWatchMessage(cctx, hv); status.Code(err) != codes.Unauthenticated || apierr.MessageOf(err) != tc.reason {
				t.Errorf("%s: WatchVirtualMachines: err = %v, want Unauthenticated %q", tc.name, err, tc.reason)
			}
		}
		// Health and reflection stay open.
		if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
			t.Errorf("health without token: %v", err)
		}
		good := grpc.PerRPCCredentials(identity.Bearer(good))
		if _, err := hv.ListNetworks(ctx, &hypervisorv1.ListNetworksRequest{}, good); err != nil {
			t.Fatalf("ListNetworks with a good token: %v", err)
		}
		if _, err := at.GetAttestationStatus(ctx, &attestationv1.GetAttestationStatusRequest{}, good); err != nil {
			t.Fatalf("GetAttestationStatus with a good token: %v", err)
		}
		if m, err := firstWatchMessage(ctx, hv, good); err != nil || m.GetType() != hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED {
			t.Errorf("WatchVirtualMachines with a good token: %v %v", m, err)
		}
		// The forwarder passes the caller's token on: the backend records it.
		nw, err := hv.CreateNetwork(ctx, &hypervisorv1.CreateNetworkRequest{Name: "grpcident", Cidr: "10.78.0.0/24"}, good)
		if err != nil {
			t.Fatalf("CreateNetwork: %v", err)
		}
		if nw.GetCreatedBy() != "ada@example.com" {
			t.Errorf("created_by = %q, want ada@example.com", nw.GetCreatedBy())
		}
		if _, err := hv.DeleteNetwork(ctx, &hypervisorv1.DeleteNetworkRequest{Name: "grpcident"}, good); err != nil {
			t.Errorf("DeleteNetwork: %v", err)
		}
	})

	t.Run("backend sockets verify again", func(t *testing.T) {
		hconn, err := mesh.Dial(c.Socket("hypervisor"))
		if err != nil {
			t.Fatal(err)
		}
		defer hconn.Close()
		hv := hypervisorv1.NewHypervisorServiceClient(hconn)
		if _, err := hv.GetHost(ctx, &hypervisorv1.GetHostRequest{}); status.Code(err) != codes.Unauthenticated || apierr.CodeOf(err) != apierr.Unauthenticated {
			t.Errorf("hypervisor socket without token: err = %v, want Unauthenticated", err)
		}
		if _, err := firstWatchMessage(ctx, hv); status.Code(err) != codes.Unauthenticated {
			t.Errorf("hypervisor socket, a watch without token: err = %v, want Unauthenticated", err)
		}
		for _, tc := range bad[1:] {
			cctx := metadata.AppendToOutgoingContext(ctx, "authorization", bearer(tc.token))
			if _, err := hv.ListNetworks(cctx, &hypervisorv1.ListNetworksRequest{}); status.Code(err) != codes.Unauthenticated {
				t.Errorf("hypervisor socket, %s token: err = %v, want Unauthenticated", tc.name, err)
			}
		}
		if _, err := hv.GetHost(ctx, &hypervisorv1.GetHostRequest{}, grpc.PerRPCCredentials(identity.Bearer(good))); err != nil {
			t.Errorf("hypervisor socket with a good token: %v", err)
		}
		if _, err := healthpb.NewHealthClient(hconn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
			t.Errorf("hypervisor health without token: %v", err)
		}

		aconn, err := mesh.Dial(c.Socket("attestation"))
		if err != nil {
			t.Fatal(err)
		}
		defer aconn.Close()
		at := attestationv1.NewAttestationServiceClient(aconn)
		if _, err := at.GetAttestationStatus(ctx, &attestationv1.GetAttestationStatusRequest{}); status.Code(err) != codes.Unauthenticated {
			t.Errorf("attestation socket without token: err = %v, want Unauthenticated", err)
		}
		if _, err := at.GetAttestationStatus(ctx, &attestationv1.GetAttestationStatusRequest{}, grpc.PerRPCCredentials(identity.Bearer(good))); err != nil {
			t.Errorf("attestation socket with a good token: %v", err)
		}
		// The VerifierService acts without a token (the hypervisor calls it on
		// behalf of guests), so it is not on the socket the gateway dials,
		// only on its own in the state directory.
		if _, err := attestationv1.NewVerifierServiceClient(aconn).ForgetVirtualMachine(ctx, &attestationv1.ForgetVirtualMachineRequest{VmId: "0123abcd"}); status.Code(err) != codes.Unimplemented {
			t.Errorf("VerifierService on attestation.sock: %v, want Unimplemented", err)
		}
		vconn, err := mesh.Dial(c.VerifierSocket())
		if err != nil {
			t.Fatal(err)
		}
		defer vconn.Close()
		if _, err := attestationv1.NewVerifierServiceClient(vconn).ForgetVirtualMachine(ctx, &attestationv1.ForgetVirtualMachineRequest{VmId: "0123abcd"}); err != nil {
			t.Errorf("VerifierService on the verifier socket, without token: %v", err)
		}
	})

	// With a token required, Host and Origin are not checked (a browser
	// never attaches the token by itself); bodies must still be JSON.
	t.Run("cross-site rules with OIDC", func(t *testing.T) {
		for _, tc := range []struct {
			req  browserRequest
			auth string
			want int
		}{
			{browserRequest{"text/plain with a good token", "POST", "/api/v1/networks", "", "", "text/plain", `{"name":"nope","cidr":"10.9.0.0/24"}`}, bearer(good), http.StatusUnsupportedMediaType},
			{browserRequest{"a proxy's Host and its portal's Origin", "GET", "/api/v1/networks", "vmm.corp.test", "https://portal.corp.test", "", ""}, bearer(good), http.StatusOK},
			{browserRequest{"a cross-site page without the token", "GET", "/api/v1/networks", "", "http://evil.example", "", ""}, "", http.StatusUnauthorized},
		} {
			req, _ := http.NewRequest(tc.req.method, base+tc.req.path, strings.NewReader(tc.req.body))
			if tc.req.host != "" {
				req.Host = tc.req.host
			}
			for k, v := range map[string]string{"Origin": tc.req.origin, "Content-Type": tc.req.contentType, "Authorization": tc.auth} {
				if v != "" {
					req.Header.Set(k, v)
				}
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != tc.want {
				t.Errorf("%s: %d %s, want %d", tc.req.name, resp.StatusCode, b, tc.want)
			}
		}
	})

	t.Run("identity-provider keys", func(t *testing.T) { keyChecks(t, c, op) })
}

// keyChecks: made-up kids do not make the gateway fetch the JWKS per
// token, and a key the provider retires stops working on every process
// within the refresh interval (a second here), with no token naming an
// unknown kid to force a fetch.
func keyChecks(t *testing.T, c *cluster.Cluster, op *oidctest.Provider) {
	api := "http://" + c.Addr + "/api/v1"
	mallory, err := oidctest.NewKey(jose.ES256)
	if err != nil {
		t.Fatal(err)
	}
	const flood = 200
	toks := make([]string, flood)
	for i := range toks {
		k := *mallory
		k.ID = fmt.Sprintf("made-up-%d", i)
		toks[i] = op.TokenWith(&k, oidctest.Claims{})
	}
	time.Sleep(1100 * time.Millisecond) // past the last fetch's minimum interval: the flood may make one
	before, fetchesBefore, start := scrapeMetrics(t, c.Addr), op.JWKSFetches(), time.Now()
	var wg sync.WaitGroup
	failures := make(chan string, flood)
	for _, tok := range toks {
		wg.Go(func() {
			req, _ := http.NewRequest("GET", api+"/host", nil)
			req.Header.Set("Authorization", "Bearer "+tok)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				failures <- err.Error()
				return
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(string(b), "token signature invalid") {
				failures <- fmt.Sprintf("%d %s", resp.StatusCode, b)
			}
		})
	}
	wg.Wait()
	close(failures)
	for e := range failures {
		t.Errorf("a made-up kid: %s", e)
	}
	elapsed, fetches := time.Since(start), op.JWKSFetches()-fetchesBefore
	after := scrapeMetrics(t, c.Addr)
	t.Logf("%d made-up kids in %s: %d JWKS fetches", flood, elapsed.Round(time.Millisecond), fetches)
	// At most one fetch per second by the gateway (the backends see none
	// of these tokens), plus one the interval's edge may add.
	if most := 2 + int(elapsed/time.Second); fetches > most || fetches < 1 {
		t.Errorf("%d made-up kids in %s made %d JWKS fetches, want 1 to %d", flood, elapsed, fetches, most)
	}
	if d := seriesValue(after, "vm_manager_oidc_unknown_key_tokens_total") - seriesValue(before, "vm_manager_oidc_unknown_key_tokens_total"); d < flood {
		t.Errorf("vm_manager_oidc_unknown_key_tokens_total rose by %v, want %d", d, flood)
	}
	// How many waited for the one fetch and how many came after it
	// (refused from the cache) depends on timing: logged, not asserted.
	t.Logf("refused from the cache without a fetch: %v", seriesValue(after, "vm_manager_oidc_jwks_fetches_denied_total")-seriesValue(before, "vm_manager_oidc_jwks_fetches_denied_total"))

	// Retirement: the current key's token works everywhere, then the
	// provider retires the key.
	retired := op.SigningKey()
	tok := op.Token(oidctest.Claims{Subject: "u-3"})
	hconn, err := mesh.Dial(c.Socket("hypervisor"))
	if err != nil {
		t.Fatal(err)
	}
	defer hconn.Close()
	hv := hypervisorv1.NewHypervisorServiceClient(hconn)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cluster.Eventually(t, 10*time.Second, "the current key", func() error {
		if code, _, b := authDo(t, "GET", api+"/networks", "Bearer "+tok, ""); code != http.StatusOK {
			return fmt.Errorf("REST: %d %s", code, b)
		}
		if _, err := hv.ListNetworks(ctx, &hypervisorv1.ListNetworksRequest{}, grpc.PerRPCCredentials(identity.Bearer(tok))); err != nil {
			return fmt.Errorf("hypervisor socket: %v", err)
		}
		return nil
	})
	if _, err := op.Rotate(jose.RS256); err != nil {
		t.Fatal(err)
	}
	op.RemoveKey(retired.ID)
	at := time.Now()
	cluster.Eventually(t, 10*time.Second, "the retired key refused", func() error {
		if code, _, b := authDo(t, "GET", api+"/networks", "Bearer "+tok, ""); code != http.StatusUnauthorized || !strings.Contains(string(b), "token signature invalid") {
			return fmt.Errorf("REST: %d %s", code, b)
		}
		if _, err := hv.ListNetworks(ctx, &hypervisorv1.ListNetworksRequest{}, grpc.PerRPCCredentials(identity.Bearer(tok))); status.Code(err) != codes.Unauthenticated {
			return fmt.Errorf("hypervisor socket: %v", err)
		}
		return nil
	})
	t.Logf("the retired key was refused by the gateway and the hypervisor %s after its retirement", time.Since(at).Round(10*time.Millisecond))
	cluster.Eventually(t, 10*time.Second, "the new key", func() error {
		if code, _, b := authDo(t, "GET", api+"/networks", "Bearer "+op.Token(oidctest.Claims{}), ""); code != http.StatusOK {
			return fmt.Errorf("REST: %d %s", code, b)
		}
		return nil
	})
}

// firstWatchMessage opens a watch and returns its first message.
func firstWatchMessage(ctx context.Context, hv hypervisorv1.HypervisorServiceClient, opts ...grpc.CallOption) (*hypervisorv1.WatchVirtualMachinesResponse, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s, err := hv.WatchVirtualMachines(ctx, &hypervisorv1.WatchVirtualMachinesRequest{}, opts...)
	if err != nil {
		return nil, err
	}
	return s.Recv()
}
