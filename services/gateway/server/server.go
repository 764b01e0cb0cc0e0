// Package server runs the gateway: one TCP listener serving the public gRPC
// API (forwarded to the backends, with reflection), REST under /api/v1
// (grpc-gateway), the OpenAPI document, /healthz and /readyz. With an OIDC
// issuer every request but the probes, metrics and the OpenAPI document needs
// a valid bearer token, which is forwarded to the backends. REST and MCP
// refuse what a web page could send them (xsite).
package server

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/giantswarm/vm-manager/gen/openapi"
	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/giantswarm/vm-manager/pkg/tracing"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/gateway/internal/connsplit"
	"github.com/giantswarm/vm-manager/services/gateway/internal/execws"
	"github.com/giantswarm/vm-manager/services/gateway/internal/mcp"
	"github.com/giantswarm/vm-manager/services/gateway/internal/metrics"
	"github.com/giantswarm/vm-manager/services/gateway/internal/proxy"
	"github.com/giantswarm/vm-manager/services/gateway/internal/rest"
	"github.com/giantswarm/vm-manager/services/gateway/internal/xsite"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"
	reflectionv1 "google.golang.org/grpc/reflection/grpc_reflection_v1"
	reflectionv1alpha "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"
)

// Config is what the gateway needs.
type Config struct {
	// Listen is the TCP address for gRPC and HTTP alike.
	Listen string
	// HypervisorSocket and AttestationSocket are the backends' unix sockets.
	HypervisorSocket  string
	AttestationSocket string
	// AllowNonLoopback lets an anonymous gateway listen beyond loopback.
	AllowNonLoopback bool
	// AllowedHosts are the names (any port) or name:port an anonymous
	// gateway answers besides its listen address and loopback with its port
	// (xsite): a reverse proxy's name, a port-forward's local port.
	AllowedHosts []string
	// Identity, with an issuer, requires a valid bearer token on every gRPC
	// call and every HTTP request but the open paths (OpenPaths), and allows
	// a non-loopback Listen. The caller's authorization is forwarded to the
	// backends, which verify it again.
	Identity identity.Config
	// Resource, with an issuer, publishes the OAuth protected resource
	// metadata naming the issuer, at which every 401 points (MCP clients
	// log in by themselves from there).
	Resource identity.ResourceConfig
	// MetricsEnabled serves Prometheus /metrics: VMs, networks and request
	// counts and latencies per surface (rest, grpc, mcp).
	MetricsEnabled bool
	// Ready, if set, receives the bound address once the gateway serves.
	Ready func(addr net.Addr)
	// TLSCertFile and TLSKeyFile, if set, serve everything on Listen over
	// TLS: gRPC as h2 and REST, MCP and the probes as HTTP/1.1 or h2 (ALPN).
	// A fleet gateway reaches its node gateways this way.
	TLSCertFile string
	TLSKeyFile  string
	// Fleet says the backend sockets are a fleet router's (fleet.Router.Serve):
	// there is no TelemetryService to scrape, so /metrics has the requests
	// only (each node's gateway has its host metrics).
	Fleet bool
	// Readiness, if set, is /readyz's check instead of the backends' health:
	// a fleet gateway is ready while one node answers, and names the nodes
	// otherwise.
	Readiness func(context.Context) error
}

// PublicServices are the services the gateway exposes. The attestation
// service's internal VerifierService is deliberately absent.
var PublicServices = []string{
	hypervisorv1.HypervisorService_ServiceDesc.ServiceName,
	attestationv1.AttestationService_ServiceDesc.ServiceName,
}

// mcpPath is MCP's endpoint, a protected resource with metadata of its own.
const mcpPath = "/mcp"

// OpenPaths are the HTTP paths served without a token when an issuer is
// set: probes, metrics and the OpenAPI document (and, served before them,
// the protected resource metadata: identity.MetadataPath).
var OpenPaths = []string{"/healthz", "/readyz", "/metrics", "/api/v1/openapi.json", "/api/v1/openapi.yaml"}

// untraced are the requests that get no span: probes and the metrics scrape.
func untraced(r *http.Request) bool {
	switch r.URL.Path {
	case "/healthz", "/readyz", "/metrics":
		return true
	}
	return false
}

// Run serves until ctx ends, then drains in-flight calls.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	if err := checkListen(cfg.Listen, cfg.AllowNonLoopback || cfg.Identity.Enabled()); err != nil {
		return err
	}
	if _, err := xsite.New(xsite.Config{AllowedHosts: cfg.AllowedHosts}); err != nil {
		return err
	}
	if cfg.Identity.Log == nil {
		cfg.Identity.Log = log
	}
	verifier, err := identity.New(ctx, cfg.Identity)
	if err != nil {
		return err
	}
	resource, err := identity.NewResource(verifier, cfg.Resource, mcpPath)
	if err != nil {
		return err
	}
	// Every backend call carries the caller's token, whoever makes it; a
	// backend that cannot be reached is "the <name> service is unavailable"
	// on every surface (mesh.DialBackend).
	hconn, err := mesh.DialBackend(cfg.HypervisorSocket, "hypervisor", identity.ForwardDialOptions()...)
	if err != nil {
		return fmt.Errorf("hypervisor socket: %w", err)
	}
	defer hconn.Close()
	aconn, err := mesh.DialBackend(cfg.AttestationSocket, "attestation", identity.ForwardDialOptions()...)
	if err != nil {
		return fmt.Errorf("attestation socket: %w", err)
	}
	defer aconn.Close()

	backends := map[string]*grpc.ClientConn{"hypervisor": hconn, "attestation": aconn}

	// gRPC: a transparent forwarder for the public services. With an issuer,
	// the interceptors verify the caller (the forwarder's streams included);
	// the forwarder passes the caller's authorization on.
	var met *metrics.Metrics
	var observe mcp.Observer
	gopts := append(tracing.ServerOptions(), verifier.ServerOptions()...)
	if cfg.MetricsEnabled {
		// The scrape has no caller: it reads the hypervisor's internal,
		// read-only TelemetryService.
		var telemetry hypervisorv1.TelemetryServiceClient
		if !cfg.Fleet {
			telemetry = hypervisorv1.NewTelemetryServiceClient(hconn)
		}
		met = metrics.New(telemetry, log)
		if telemetry != nil {
			met.AddPools(telemetry)
		}
		observe = met.ObserveMCP
		if verifier != nil {
			met.AddKeyStats(verifier.KeyStats)
		}
		gopts = append(gopts, grpc.ChainUnaryInterceptor(met.UnaryServerInterceptor()), grpc.ChainStreamInterceptor(met.StreamServerInterceptor()))
	}
	// Watch streams never end by themselves: they end (unavailable, with
	// the revision to resume from) when the drain starts.
	streams, endStreams := context.WithCancel(context.Background())
	defer endStreams()
	// As on the mesh: fixed windows (no flow-control PING per message),
	// stream workers. gRPC's own transport (connsplit) enforces a keepalive
	// policy, net/http's did not: a client may ping every 5 s, idle or not,
	// without being sent away (a watch that sends nothing for minutes; a
	// fleet gateway's connection pings at mesh.KeepaliveTime).
	gopts = append(gopts, mesh.ServerTransportOptions()...)
	gopts = append(gopts, grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: mesh.KeepaliveTime / 2, PermitWithoutStream: true}))
	gs := grpc.NewServer(append(gopts,
		grpc.UnknownServiceHandler(proxy.DrainingHandler(proxy.Routes{
			hypervisorv1.HypervisorService_ServiceDesc.ServiceName:   hconn,
			attestationv1.AttestationService_ServiceDesc.ServiceName: aconn,
		}, streams, []string{hypervisorv1.HypervisorService_WatchVirtualMachines_FullMethodName})),
		grpc.ForceServerCodecV2(proxy.Codec{}),
	)...)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(gs, hs)
	refl := reflection.ServerOptions{Services: publicServiceInfo{gs}}
	reflectionv1.RegisterServerReflectionServer(gs, reflection.NewServerV1(refl))
	reflectionv1alpha.RegisterServerReflectionServer(gs, reflection.NewServer(refl))

	// REST through grpc-gateway, straight to the backends' clients.
	gw := rest.NewMux(log)
	if err := hypervisorv1.RegisterHypervisorServiceHandlerClient(ctx, gw, hypervisorv1.NewHypervisorServiceClient(hconn)); err != nil {
		return err
	}
	if err := attestationv1.RegisterAttestationServiceHandlerClient(ctx, gw, attestationv1.NewAttestationServiceClient(aconn)); err != nil {
		return err
	}

	mux := http.NewServeMux()
	mux.HandleFunc("GET /api/v1/openapi.json", serveBytes("application/json", openapi.JSON))
	mux.HandleFunc("GET /api/v1/openapi.yaml", serveBytes("application/yaml", openapi.YAML))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) })
	if cfg.Readiness != nil {
		mux.HandleFunc("GET /readyz", readyzFunc(cfg.Readiness))
	} else {
		mux.HandleFunc("GET /readyz", readyz(backends))
	}
	var api http.Handler = rest.HeadAsGet(rest.LimitBody(gw))
	if met != nil {
		api = met.HTTP(metrics.SurfaceREST, api)
		mux.Handle("GET /metrics", met.Handler())
	}
	mux.Handle("/api/v1/", api)
	// The watch streams: its own handler, for SSE and a line per message.
	var watch http.Handler = rest.Watch(hypervisorv1.NewHypervisorServiceClient(hconn), streams, log)
	if met != nil {
		watch = met.HTTP(metrics.SurfaceREST, watch)
	}
	mux.Handle("GET "+rest.WatchPath, watch)
	// The image import's progress: the watch's framing (rest.Import says why).
	var imports http.Handler = rest.Import(hypervisorv1.NewHypervisorServiceClient(hconn), log)
	if met != nil {
		imports = met.HTTP(metrics.SurfaceREST, imports)
	}
	mux.Handle("POST "+rest.ImportPath, imports)
	// Streamed exec as a WebSocket next to REST (subprotocol vmm.exec.v1).
	mux.Handle(execws.Path, execws.Handler(hypervisorv1.NewHypervisorServiceClient(hconn), log))
	// MCP (streamable HTTP); its tool calls reach the backends with the
	// caller's token like REST's.
	mcpHandler := newMCPDrain(mcp.New(hypervisorv1.NewHypervisorServiceClient(hconn), attestationv1.NewAttestationServiceClient(aconn), log, observe))
	defer mcpHandler.drain()
	// The SDK runs tool calls on the session's context: the request's span
	// reaches them in the traceparent header it hands them.
	mux.Handle(mcpPath, tracing.InHeader(mcpHandler))
	mux.HandleFunc("/", rest.NotFound)

	tlsCfg, err := loadTLS(cfg.TLSCertFile, cfg.TLSKeyFile)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return err
	}
	defer ln.Close() // Serve closes it; not when a step below fails

	// Web pages are kept out first (xsite: JSON bodies only; an anonymous
	// gateway checks Host and Origin). Then, with an issuer, everything on
	// the mux but OpenPaths needs a token, and the protected resource
	// metadata is served before the guard; grpc-gateway forwards the
	// Authorization header as "authorization".
	open := identity.OpenPaths(OpenPaths...)
	guard, err := xsite.New(xsite.Config{
		CheckHosts:   !cfg.Identity.Enabled(),
		Listen:       boundListen(cfg.Listen, ln.Addr()),
		AllowedHosts: cfg.AllowedHosts,
		Exempt: func(r *http.Request) bool {
			return (r.Method == http.MethodGet || r.Method == http.MethodHead) && open(r)
		},
		Refused: met.Refused,
		Log:     log,
	})
	if err != nil {
		return err
	}
	// A browser's WebSocket carries its token as a subprotocol (execws).
	guarded := guard.Handler(execws.LiftToken(resource.HTTP(rest.RefuseUncleanPaths(mux), open)))
	// A span per request, refused ones included; the probes and the
	// metrics scrape get none.
	guarded = tracing.HTTP(guarded, untraced, func(r *http.Request) string { return metrics.NormalizePath(r.URL.EscapedPath()) })
	root := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ProtoMajor == 2 && strings.HasPrefix(r.Header.Get("Content-Type"), "application/grpc") {
			gs.ServeHTTP(w, r)
			return
		}
		guarded.ServeHTTP(w, r)
	})

	var protocols http.Protocols
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true) // gRPC without TLS (prior knowledge), as grpcurl -plaintext speaks it
	protocols.SetHTTP2(true)            // gRPC over TLS (ALPN h2)
	srv := &http.Server{
		TLSConfig:         tlsCfg,
		Handler:           root,
		Protocols:         &protocols,
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	srv.RegisterOnShutdown(mcpHandler.drain)
	srv.RegisterOnShutdown(endStreams)
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	log.Info("gateway serving", "listen", ln.Addr().String(), "tls", tlsCfg != nil, "hypervisor", cfg.HypervisorSocket, "attestation", cfg.AttestationSocket, "oidc_issuer", verifier.Issuer(), "public_url", cfg.Resource.PublicURL)
	if cfg.Ready != nil {
		cfg.Ready(ln.Addr())
	}

	// Plaintext: gRPC connections go to the gRPC server's own transport, a
	// hop much cheaper than ServeHTTP; the rest to srv (connsplit). Over TLS
	// (a fleet's node gateways) both go through srv, gRPC by ServeHTTP: the
	// split reads the HTTP/2 preface, which TLS hides.
	errc := make(chan error, 2)
	var split *connsplit.Split
	if tlsCfg != nil {
		go func() { errc <- srv.ServeTLS(ln, "", "") }()
	} else {
		split = connsplit.New(ln)
		defer split.Close()
		go func() { errc <- srv.Serve(split.HTTP) }()
		go func() { errc <- gs.Serve(split.GRPC) }()
	}
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	if split != nil {
		_ = split.Close() // no new connections, as Shutdown's closing its listener did
	}
	hs.Shutdown()
	shutdownCtx, cancel := context.WithTimeout(context.Background(), mesh.DrainTimeout)
	defer cancel()
	endStreams()
	grpcDone := make(chan struct{})
	go func() { gs.GracefulStop(); close(grpcDone) }()
	err = srv.Shutdown(shutdownCtx)
	select {
	case <-grpcDone:
	case <-shutdownCtx.Done():
	}
	gs.Stop()
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	log.Info("gateway stopped")
	return err
}

// mcpDrain ends MCP's standalone SSE streams (a GET each session holds
// open for the server's notifications) when the gateway drains: they never
// end by themselves, so Shutdown would wait its whole timeout for them. They
// end once the session's other requests (POSTs: the tool calls) are done, as
// a client may give its session up, tool calls in flight included, when its
// stream ends.
type mcpDrain struct {
	h http.Handler

	mu       sync.Mutex
	inflight int  // requests other than GET
	draining bool // Shutdown has begun
	streams  context.Context
	end      context.CancelFunc // ends the GET streams
}

func newMCPDrain(h http.Handler) *mcpDrain {
	d := &mcpDrain{h: h}
	d.streams, d.end = context.WithCancel(context.Background())
	return d
}

func (d *mcpDrain) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		d.mu.Lock()
		d.inflight++
		d.mu.Unlock()
		defer func() {
			d.mu.Lock()
			if d.inflight--; d.inflight == 0 && d.draining {
				d.end()
			}
			d.mu.Unlock()
		}()
		d.h.ServeHTTP(w, r)
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	defer context.AfterFunc(d.streams, cancel)()
	d.h.ServeHTTP(w, r.WithContext(ctx))
}

// drain ends the streams as soon as no other request is in flight.
func (d *mcpDrain) drain() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.draining = true
	if d.inflight == 0 {
		d.end()
	}
}

// boundListen is the listen address as configured with the port bound (":0"
// picks one).
func boundListen(configured string, bound net.Addr) string {
	host, _, _ := net.SplitHostPort(configured) // checkListen parsed it
	_, port, _ := net.SplitHostPort(bound.String())
	return net.JoinHostPort(host, port)
}

// checkListen refuses a non-loopback address for an anonymous API.
func checkListen(addr string, allow bool) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("listen address %q: %w", addr, err)
	}
	if allow {
		return nil
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return nil
	}
	return fmt.Errorf("listen address %q is not loopback: without an OIDC issuer the API is anonymous; bind 127.0.0.1, set --oidc-issuer or pass --allow-anonymous-non-loopback", addr)
}

func serveBytes(contentType string, b []byte) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", contentType)
		_, _ = w.Write(b)
	}
}

// readyz checks every backend's gRPC health, each bounded to a second, so a
// dead backend makes the gateway unready instead of hanging the probe.
func readyz(backends map[string]*grpc.ClientConn) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var (
			mu       sync.Mutex
			problems []string
			wg       sync.WaitGroup
		)
		for name, conn := range backends {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(r.Context(), time.Second)
				defer cancel()
				resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
				if err == nil && resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
					err = fmt.Errorf("status %s", resp.GetStatus())
				}
				if err != nil {
					mu.Lock()
					problems = append(problems, fmt.Sprintf("%s: %v", name, err))
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		if len(problems) > 0 {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("not ready: " + strings.Join(problems, "; ") + "\n"))
			return
		}
		_, _ = w.Write([]byte("ok"))
	}
}

// readyzFunc answers /readyz with check's verdict, bounded to 2 seconds.
func readyzFunc(check func(context.Context) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := check(ctx); err != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("not ready: " + apierr.MessageOf(err) + "\n"))
			return
		}
		_, _ = w.Write([]byte("ok"))
	}
}

// publicServiceInfo lists the public services (plus health and reflection)
// for reflection: the forwarder registers none of them itself.
type publicServiceInfo struct{ s *grpc.Server }

func (p publicServiceInfo) GetServiceInfo() map[string]grpc.ServiceInfo {
	out := p.s.GetServiceInfo()
	for _, name := range PublicServices {
		out[name] = grpc.ServiceInfo{}
	}
	return out
}

// loadTLS is the listener's TLS configuration, or nil without a
// certificate. The pair is read once at start; a renewed certificate takes
// a restart (a rolling one in Kubernetes).
func loadTLS(certFile, keyFile string) (*tls.Config, error) {
	if certFile == "" && keyFile == "" {
		return nil, nil
	}
	if certFile == "" || keyFile == "" {
		return nil, fmt.Errorf("--tls-cert-file and --tls-key-file go together")
	}
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("TLS certificate: %w", err)
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}, nil
}
