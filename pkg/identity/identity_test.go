package identity_test

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/identity/oidctest"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	jose "github.com/go-jose/go-jose/v4"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
)

func newVerifier(t *testing.T, p *oidctest.Provider, audiences ...string) *identity.Verifier {
	t.Helper()
	if len(audiences) == 0 {
		audiences = []string{"vm-manager"}
	}
	return newVerifierConfig(t, identity.Config{Issuer: p.Issuer(), Audiences: audiences})
}

func newVerifierConfig(t *testing.T, cfg identity.Config) *identity.Verifier {
	t.Helper()
	v, err := identity.New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if v == nil {
		t.Fatal("New with an issuer returned a nil verifier")
	}
	return v
}

func TestAnonymous(t *testing.T) {
	v, err := identity.New(context.Background(), identity.Config{})
	if err != nil || v != nil {
		t.Fatalf("New without issuer = %v, %v; want nil, nil", v, err)
	}
	called := false
	h := v.HTTP(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { called = true }), nil)
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/api/v1/host", nil))
	if !called {
		t.Error("anonymous middleware did not pass the request")
	}
	if _, err := v.UnaryServerInterceptor()(context.Background(), nil, &grpc.UnaryServerInfo{FullMethod: "/x.Y/Z"}, func(context.Context, any) (any, error) { return nil, nil }); err != nil {
		t.Errorf("anonymous unary interceptor: %v", err)
	}
	if opts := v.ServerOptions(); opts != nil {
		t.Errorf("anonymous ServerOptions = %v, want none", opts)
	}
	if got := identity.FromContext(context.Background()).String(); got != "" {
		t.Errorf("anonymous caller = %q, want empty", got)
	}
}

func TestNewConfigErrors(t *testing.T) {
	p := oidctest.Start(t)
	if _, err := identity.New(context.Background(), identity.Config{Issuer: p.Issuer()}); err == nil || !strings.Contains(err.Error(), "audience") {
		t.Errorf("no audiences: err = %v", err)
	}
	// The discovery document names the issuer without the trailing slash.
	if _, err := identity.New(context.Background(), identity.Config{Issuer: p.Issuer() + "/", Audiences: []string{"a"}}); err == nil || !strings.Contains(err.Error(), "different issuer") {
		t.Errorf("issuer mismatch: err = %v", err)
	}
	if _, err := identity.New(context.Background(), identity.Config{Issuer: "http://127.0.0.1:1", Audiences: []string{"a"}}); err == nil || !strings.Contains(err.Error(), "discovery") {
		t.Errorf("unreachable issuer: err = %v", err)
	}
}

func TestVerify(t *testing.T) {
	p := oidctest.Start(t)
	v := newVerifier(t, p, "vm-manager", "portal")
	stranger, err := oidctest.NewKey(jose.RS256)
	if err != nil {
		t.Fatal(err)
	}
	// Same kid as the published key, different key material.
	impostor, err := oidctest.NewKey(jose.RS256)
	if err != nil {
		t.Fatal(err)
	}
	impostor.ID = p.SigningKey().ID
	now := time.Now()

	good := []struct {
		name  string
		token string
	}{
		{"plain", p.Token(oidctest.Claims{})},
		{"second trusted audience among others", p.Token(oidctest.Claims{Audience: []string{"other", "portal"}})},
		{"audience as a string", p.Token(oidctest.Claims{Extra: map[string]any{"aud": "vm-manager"}})},
		{"expired within the clock skew", p.Token(oidctest.Claims{Expiry: now.Add(-10 * time.Second)})},
		{"iat slightly ahead", p.Token(oidctest.Claims{IssuedAt: now.Add(10 * time.Second)})},
	}
	for _, tc := range good {
		t.Run("good/"+tc.name, func(t *testing.T) {
			if _, err := v.Verify(context.Background(), tc.token); err != nil {
				t.Fatalf("Verify: %v", err)
			}
		})
	}

	bad := []struct {
		name, token, reason string
	}{
		{"missing", "", "missing bearer token"},
		{"not a jwt", "not-a-jwt", "malformed token"},
		{"garbage segments", "a.b.c", "malformed token"},
		{"expired", p.Token(oidctest.Claims{Expiry: now.Add(-time.Minute), IssuedAt: now.Add(-time.Hour)}), "token expired"},
		{"no expiry", p.Token(oidctest.Claims{NoExpiry: true}), "token has no expiry"},
		{"issued in the future", p.Token(oidctest.Claims{IssuedAt: now.Add(5 * time.Minute)}), "token issued in the future"},
		{"not yet valid", p.Token(oidctest.Claims{NotBefore: now.Add(5 * time.Minute)}), "token not yet valid"},
		{"wrong issuer", p.Token(oidctest.Claims{Issuer: "https://evil.example.com"}), "token issuer not trusted"},
		{"wrong audience", p.Token(oidctest.Claims{Audience: []string{"someone-else"}}), "token audience not trusted"},
		{"no audience", p.Token(oidctest.Claims{Audience: []string{}}), "token audience not trusted"},
		{"no subject", p.Token(oidctest.Claims{Extra: map[string]any{"sub": ""}}), "token has no subject"},
		{"alg none", p.Unsigned(oidctest.Claims{}), "token signature algorithm not supported"},
		{"key not in the jwks", p.TokenWith(stranger, oidctest.Claims{}), "token signature invalid"},
		{"known kid, other key", p.TokenWith(impostor, oidctest.Claims{}), "token signature invalid"},
		{"tampered payload", tamper(p.Token(oidctest.Claims{Subject: "alice"}), p.Unsigned(oidctest.Claims{Subject: "mallory"})), "token signature invalid"},
	}
	for _, tc := range bad {
		t.Run("bad/"+tc.name, func(t *testing.T) {
			_, err := v.Verify(context.Background(), tc.token)
			if apierr.CodeOf(err) != apierr.Unauthenticated {
				t.Fatalf("Verify: err = %v (code %q), want unauthenticated", err, apierr.CodeOf(err))
			}
			if apierr.MessageOf(err) != tc.reason {
				t.Errorf("reason = %q, want %q", apierr.MessageOf(err), tc.reason)
			}
			if tc.token != "" && len(tc.token) > 8 && strings.Contains(err.Error(), tc.token) {
				t.Error("the error leaks the token")
			}
		})
	}
}

// tamper puts other's payload under tok's header and signature.
func tamper(tok, other string) string {
	parts, o := strings.Split(tok, "."), strings.Split(other, ".")
	return parts[0] + "." + o[1] + "." + parts[2]
}

func TestIdentityClaims(t *testing.T) {
	p := oidctest.Start(t)
	v := newVerifier(t, p)
	id, err := v.Verify(context.Background(), p.Token(oidctest.Claims{Subject: "u-42", Email: "ada@example.com", Name: "Ada", Groups: []string{"ops", "dev"}}))
	if err != nil {
		t.Fatal(err)
	}
	if id.Subject != "u-42" || id.Email != "ada@example.com" || id.Name != "Ada" || !slices.Equal(id.Groups, []string{"ops", "dev"}) {
		t.Errorf("identity = %+v", id)
	}
	if id.String() != "ada@example.com" {
		t.Errorf("String() = %q, want the email", id.String())
	}
	id, err = v.Verify(context.Background(), p.Token(oidctest.Claims{Subject: "svc-7"}))
	if err != nil {
		t.Fatal(err)
	}
	if id.String() != "svc-7" {
		t.Errorf("String() without email = %q, want the subject", id.String())
	}
	ctx := identity.NewContext(context.Background(), id)
	if identity.FromContext(ctx).Subject != "svc-7" {
		t.Error("FromContext lost the identity")
	}
}

func TestKeyRotation(t *testing.T) {
	p := oidctest.Start(t)
	// Rotations back to back: no minimum between fetches here (the rate
	// limit has tests of its own, in jwks_test.go).
	v := newVerifierConfig(t, identity.Config{Issuer: p.Issuer(), Audiences: []string{"vm-manager"}, JWKSMinFetchInterval: time.Nanosecond})
	if _, err := v.Verify(context.Background(), p.Token(oidctest.Claims{})); err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(context.Background(), p.Token(oidctest.Claims{})); err != nil {
		t.Fatal(err)
	}
	if n := p.JWKSFetches(); n != 1 {
		t.Errorf("JWKS fetched %d times for two tokens of one key, want 1 (cached)", n)
	}
	old := p.SigningKey()
	oldToken := p.Token(oidctest.Claims{})
	for i, alg := range []jose.SignatureAlgorithm{jose.ES256, jose.RS256} {
		if _, err := p.Rotate(alg); err != nil {
			t.Fatal(err)
		}
		if _, err := v.Verify(context.Background(), p.Token(oidctest.Claims{})); err != nil {
			t.Fatalf("token signed with the rotated %s key: %v", alg, err)
		}
		if n := p.JWKSFetches(); n != 2+i {
			t.Errorf("after rotation %d: JWKS fetched %d times, want %d (one refetch for the unknown kid)", i+1, n, 2+i)
		}
	}
	// The old key is still published: its tokens stay valid.
	if _, err := v.Verify(context.Background(), oldToken); err != nil {
		t.Errorf("token of the previous key: %v", err)
	}
	// Retired: once the verifier refetches, the old key is gone.
	p.RemoveKey(old.ID)
	if _, err := p.Rotate(jose.RS256); err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(context.Background(), p.Token(oidctest.Claims{})); err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(context.Background(), oldToken); apierr.MessageOf(err) != "token signature invalid" {
		t.Errorf("token of a retired key: err = %v", err)
	}
}

func TestKeysUnavailable(t *testing.T) {
	p, err := oidctest.New()
	if err != nil {
		t.Fatal(err)
	}
	v := newVerifier(t, p)
	tok := p.Token(oidctest.Claims{})
	p.Close()
	_, err = v.Verify(context.Background(), tok)
	if apierr.CodeOf(err) != apierr.Unauthenticated || apierr.MessageOf(err) != "token signing keys unavailable" {
		t.Errorf("issuer down: err = %v", err)
	}
}

func TestHTTPMiddleware(t *testing.T) {
	p := oidctest.Start(t)
	v := newVerifier(t, p)
	var (
		mu     sync.Mutex
		caller identity.Identity
		token  string
	)
	h := v.HTTP(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		caller, token = identity.FromContext(r.Context()), identity.BearerFromContext(r.Context())
		mu.Unlock()
		_, _ = io.WriteString(w, "ok")
	}), identity.OpenPaths("/healthz", "/readyz", "/metrics", "/api/v1/openapi.json"))
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)

	get := func(path string, auth ...string) (*http.Response, string) {
		t.Helper()
		req, _ := http.NewRequest("GET", srv.URL+path, nil)
		for _, a := range auth {
			req.Header.Add("Authorization", a)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}

	good := p.Token(oidctest.Claims{Email: "ada@example.com"})
	resp, body := get("/api/v1/host", "Bearer "+good)
	if resp.StatusCode != 200 || body != "ok" {
		t.Fatalf("good token: %d %s", resp.StatusCode, body)
	}
	mu.Lock()
	if caller.String() != "ada@example.com" || token != good {
		t.Errorf("context: caller %q, token forwarded %t", caller.String(), token == good)
	}
	mu.Unlock()
	if resp, _ := get("/api/v1/host", "bearer "+good); resp.StatusCode != 200 {
		t.Errorf("lower-case scheme: %d", resp.StatusCode)
	}

	for _, path := range []string{"/healthz", "/readyz", "/metrics", "/api/v1/openapi.json"} {
		if resp, _ := get(path); resp.StatusCode != 200 {
			t.Errorf("open path %s without token: %d", path, resp.StatusCode)
		}
	}

	refused := []struct {
		name      string
		auth      []string
		reason    string
		presented bool
	}{
		{"no header", nil, "missing bearer token", false},
		{"basic", []string{"Basic dXNlcjpwYXNz"}, "authorization is not a bearer token", true},
		{"empty bearer", []string{"Bearer "}, "missing bearer token", true},
		{"two headers", []string{"Bearer " + good, "Bearer " + good}, "more than one authorization value", true},
		{"expired", []string{"Bearer " + p.Token(oidctest.Claims{Expiry: time.Now().Add(-time.Hour)})}, "token expired", true},
		{"wrong audience", []string{"Bearer " + p.Token(oidctest.Claims{Audience: []string{"x"}})}, "token audience not trusted", true},
		{"alg none", []string{"Bearer " + p.Unsigned(oidctest.Claims{})}, "token signature algorithm not supported", true},
	}
	for _, tc := range refused {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := get("/api/v1/host", tc.auth...)
			if resp.StatusCode != http.StatusUnauthorized {
				t.Fatalf("status %d, want 401", resp.StatusCode)
			}
			wa := resp.Header.Get("WWW-Authenticate")
			if !strings.HasPrefix(wa, `Bearer realm="vm-manager"`) {
				t.Errorf("WWW-Authenticate = %q", wa)
			}
			if got := strings.Contains(wa, `error="invalid_token"`); got != tc.presented {
				t.Errorf("WWW-Authenticate = %q: error=invalid_token present %t, want %t", wa, got, tc.presented)
			}
			if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type = %q", ct)
			}
			var env struct {
				Error struct{ Code, Message string } `json:"error"`
			}
			if err := json.Unmarshal([]byte(body), &env); err != nil {
				t.Fatalf("body %q: %v", body, err)
			}
			if env.Error.Code != "unauthenticated" || env.Error.Message != tc.reason {
				t.Errorf("envelope = %+v, want unauthenticated / %q", env.Error, tc.reason)
			}
			if len(tc.auth) > 0 && len(tc.auth[0]) > 20 && strings.Contains(body+wa, strings.TrimPrefix(tc.auth[0], "Bearer ")) {
				t.Error("the response leaks the token")
			}
		})
	}
}

// hypervisor records the caller of GetHost.
type hypervisor struct {
	hypervisorv1.UnimplementedHypervisorServiceServer
	mu     sync.Mutex
	caller string
}

func (h *hypervisor) GetHost(ctx context.Context, _ *hypervisorv1.GetHostRequest) (*hypervisorv1.Host, error) {
	h.mu.Lock()
	h.caller = identity.FromContext(ctx).String()
	h.mu.Unlock()
	return &hypervisorv1.Host{}, nil
}

func TestGRPCInterceptors(t *testing.T) {
	p := oidctest.Start(t)
	v := newVerifier(t, p)

	hv := &hypervisor{}
	var streamCaller, streamToken string
	var mu sync.Mutex
	srv := grpc.NewServer(append(v.ServerOptions("open.v1.Service"),
		// A stream for every other service, as the gateway's forwarder.
		grpc.UnknownServiceHandler(func(_ any, ss grpc.ServerStream) error {
			mu.Lock()
			streamCaller, streamToken = identity.FromContext(ss.Context()).String(), identity.BearerFromContext(ss.Context())
			mu.Unlock()
			var in emptypb.Empty
			if err := ss.RecvMsg(&in); err != nil {
				return err
			}
			return ss.SendMsg(&emptypb.Empty{})
		}))...)
	hypervisorv1.RegisterHypervisorServiceServer(srv, hv)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	client := hypervisorv1.NewHypervisorServiceClient(conn)
	ctx := context.Background()
	withToken := func(tok string) context.Context {
		return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	good := p.Token(oidctest.Claims{Email: "ada@example.com"})

	// Health needs no token.
	if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Errorf("health without token: %v", err)
	}
	// Unary.
	for name, cctx := range map[string]context.Context{
		"none":    ctx,
		"expired": withToken(p.Token(oidctest.Claims{Expiry: time.Now().Add(-time.Hour)})),
		"garbage": withToken("garbage"),
		"issuer":  withToken(p.Token(oidctest.Claims{Issuer: "https://elsewhere"})),
	} {
		_, err := client.GetHost(cctx, &hypervisorv1.GetHostRequest{})
		if status.Code(err) != codes.Unauthenticated || apierr.CodeOf(err) != apierr.Unauthenticated {
			t.Errorf("unary, %s token: err = %v, want Unauthenticated with ErrorInfo", name, err)
		}
	}
	if _, err := client.GetHost(withToken(good), &hypervisorv1.GetHostRequest{}); err != nil {
		t.Fatalf("unary with a good token: %v", err)
	}
	if hv.caller != "ada@example.com" {
		t.Errorf("handler saw caller %q", hv.caller)
	}
	if _, err := client.GetHost(ctx, &hypervisorv1.GetHostRequest{}, grpc.PerRPCCredentials(identity.Bearer(good))); err != nil {
		t.Errorf("unary with identity.Bearer credentials: %v", err)
	}

	// Stream (the unknown-service handler).
	call := func(ctx context.Context, method string) error {
		return conn.Invoke(ctx, method, &emptypb.Empty{}, &emptypb.Empty{})
	}
	if err := call(ctx, "/some.v1.Service/Do"); status.Code(err) != codes.Unauthenticated {
		t.Errorf("stream without token: err = %v", err)
	}
	if err := call(withToken(p.Unsigned(oidctest.Claims{})), "/some.v1.Service/Do"); status.Code(err) != codes.Unauthenticated {
		t.Errorf("stream with alg none: err = %v", err)
	}
	if err := call(withToken(good), "/some.v1.Service/Do"); err != nil {
		t.Fatalf("stream with a good token: %v", err)
	}
	mu.Lock()
	if streamCaller != "ada@example.com" || streamToken != good {
		t.Errorf("stream handler saw caller %q, token kept %t", streamCaller, streamToken == good)
	}
	mu.Unlock()
	// A service named open needs no token.
	if err := call(ctx, "/open.v1.Service/Do"); err != nil {
		t.Errorf("open service without token: %v", err)
	}
	// Two authorization values are refused.
	two := metadata.AppendToOutgoingContext(withToken(good), "authorization", "Bearer "+good)
	if err := call(two, "/some.v1.Service/Do"); status.Code(err) != codes.Unauthenticated {
		t.Errorf("two authorization values: err = %v", err)
	}
}

func TestOutgoingContext(t *testing.T) {
	if ctx := identity.OutgoingContext(context.Background()); ctx != context.Background() {
		t.Error("OutgoingContext without a token changed the context")
	}
	p := oidctest.Start(t)
	v := newVerifier(t, p)
	tok := p.Token(oidctest.Claims{})
	var got metadata.MD
	h := v.HTTP(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		ctx := metadata.AppendToOutgoingContext(r.Context(), "x-other", "1")
		got, _ = metadata.FromOutgoingContext(identity.OutgoingContext(ctx))
	}), nil)
	req := httptest.NewRequest("GET", "/x", nil)
	req.Header.Set("Authorization", "Bearer "+tok)
	h.ServeHTTP(httptest.NewRecorder(), req)
	if a := got.Get("authorization"); len(a) != 1 || a[0] != "Bearer "+tok {
		t.Errorf("outgoing authorization = %v", a)
	}
	if got.Get("x-other") == nil {
		t.Error("OutgoingContext dropped other metadata")
	}
}

func TestForwardDialOptions(t *testing.T) {
	p := oidctest.Start(t)
	v := newVerifier(t, p)
	hv := &hypervisor{}
	srv := grpc.NewServer(v.ServerOptions()...)
	hypervisorv1.RegisterHypervisorServiceServer(srv, hv)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient(ln.Addr().String(), append(identity.ForwardDialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	client := hypervisorv1.NewHypervisorServiceClient(conn)

	// A backend call made while serving an authenticated HTTP request carries
	// the caller without the handler doing anything.
	tok := p.Token(oidctest.Claims{Email: "ada@example.com"})
	var callErr error
	h := v.HTTP(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		_, callErr = client.GetHost(r.Context(), &hypervisorv1.GetHostRequest{})
	}), nil)
	req := httptest.NewRequest("GET", "/x", nil)
	req.Header.Set("Authorization", "Bearer "+tok)
	h.ServeHTTP(httptest.NewRecorder(), req)
	if callErr != nil {
		t.Fatalf("call from an authenticated request: %v", callErr)
	}
	if hv.caller != "ada@example.com" {
		t.Errorf("backend saw caller %q", hv.caller)
	}
	// An explicit authorization is kept, not doubled (two would be refused).
	other := p.Token(oidctest.Claims{Subject: "svc-9"})
	ctx := identity.NewContext(context.Background(), identity.Identity{})
	h = v.HTTP(http.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) {
		ctx := metadata.AppendToOutgoingContext(r.Context(), "authorization", "Bearer "+other)
		_, callErr = client.GetHost(ctx, &hypervisorv1.GetHostRequest{})
	}), nil)
	h.ServeHTTP(httptest.NewRecorder(), req)
	if callErr != nil || hv.caller != "svc-9" {
		t.Errorf("explicit authorization: err %v, caller %q", callErr, hv.caller)
	}
	// Without a token on the context nothing is added.
	if _, err := client.GetHost(ctx, &hypervisorv1.GetHostRequest{}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("call without a caller: err = %v, want Unauthenticated", err)
	}
}
