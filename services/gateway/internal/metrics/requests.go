package metrics

import (
	"context"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// Labels for what is not a known route or method; they keep the label sets
// bounded whatever callers send.
const (
	unmatchedPath   = "{unmatched}"
	unknownMethod   = "unknown"
	otherHTTPMethod = "OTHER"
)

// HTTP counts and times the requests next serves on surface (rest, or mcp
// when only transport-level numbers are wanted; tool calls are ObserveMCP's).
// The method label is the HTTP method and the route: the http.ServeMux
// pattern the request matched, when next is (or ends in) a ServeMux and the
// pattern is not a subtree; otherwise the path with its ids replaced by
// position (/api/v1/vms/{id}/start, /api/v1/networks/{name},
// /api/v1/images/{ref}/policy), and "{unmatched}" for anything unknown. The
// code label is the HTTP status.
func (m *Metrics) HTTP(surface string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		sw := &statusWriter{ResponseWriter: w}
		next.ServeHTTP(sw, r)
		m.observe(surface, RouteLabel(r), strconv.Itoa(sw.code()), time.Since(start))
	})
}

// RouteLabel is the method label HTTP gives r: "<METHOD> <route>".
func RouteLabel(r *http.Request) string {
	method := httpMethod(r.Method)
	if p := r.Pattern; p != "" {
		if i := strings.IndexByte(p, ' '); i >= 0 { // "GET /healthz": the request's own method wins (HEAD)
			p = strings.TrimLeft(p[i+1:], " \t")
		}
		if !strings.HasSuffix(p, "/") && !strings.HasSuffix(p, "...}") && !strings.HasPrefix(p, "/{") {
			return method + " " + p
		}
	}
	return method + " " + NormalizePath(r.URL.EscapedPath())
}

func httpMethod(m string) string {
	switch m {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
		http.MethodDelete, http.MethodOptions, http.MethodConnect, http.MethodTrace:
		return m
	}
	return otherHTTPMethod
}

// vmSubresources are the fixed segments after /api/v1/vms/{id}.
var vmSubresources = map[string]bool{
	"start": true, "stop": true, "reboot": true, "exec": true, "forward": true, "suspend": true, "resume": true,
	"console": true, "attestation": true, "metrics": true, "report": true,
}

// topLevel are the paths kept as they are.
var topLevel = map[string]bool{
	"/healthz": true, "/readyz": true, "/metrics": true, "/mcp": true,
	"/api/v1/host": true, "/api/v1/images": true, "/api/v1/networks": true, "/api/v1/vms": true,
	"/api/v1/vms:watch": true, "/api/v1/images:import": true,
	"/api/v1/attestation": true, "/api/v1/policies": true,
	"/api/v1/openapi.yaml": true, "/api/v1/openapi.json": true,
}

// NormalizePath replaces the ids in an API path by their route variables, by
// position, and anything it does not know by "{unmatched}".
func NormalizePath(path string) string {
	if topLevel[path] {
		return path
	}
	rest, ok := strings.CutPrefix(path, "/api/v1/")
	if !ok {
		return unmatchedPath
	}
	seg := strings.Split(rest, "/")
	if slices.Contains(seg, "") {
		return "/api/v1/" + unmatchedPath
	}
	switch {
	case seg[0] == "vms" && len(seg) == 2:
		return "/api/v1/vms/{id}"
	case seg[0] == "vms" && len(seg) == 3 && vmSubresources[seg[2]]:
		return "/api/v1/vms/{id}/" + seg[2]
	case seg[0] == "networks" && len(seg) == 2:
		return "/api/v1/networks/{name}"
	case seg[0] == "images" && len(seg) == 2:
		return "/api/v1/images/{ref}"
	case seg[0] == "images" && len(seg) == 3 && seg[2] == "policy":
		return "/api/v1/images/{ref}/policy"
	case seg[0] == "images" && len(seg) == 4 && seg[2] == "policy" && seg[3] == "golden":
		return "/api/v1/images/{ref}/policy/golden"
	}
	return "/api/v1/" + unmatchedPath
}

// statusWriter remembers the status a handler sent.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 && code >= 200 { // 1xx are interim
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// Flush keeps streaming responses (SSE, gRPC over ServeHTTP) working.
func (w *statusWriter) Flush() {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	_ = http.NewResponseController(w.ResponseWriter).Flush()
}

// Unwrap lets http.ResponseController reach the underlying writer.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *statusWriter) code() int {
	if w.status == 0 {
		return http.StatusOK // nothing written: net/http sends 200
	}
	return w.status
}

// UnaryServerInterceptor counts and times unary gRPC calls on the grpc
// surface: method is the full method name, code the status code's name.
func (m *Metrics) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		start := time.Now()
		resp, err := handler(ctx, req)
		m.observe(SurfaceGRPC, GRPCMethodLabel(info.FullMethod), status.Code(err).String(), time.Since(start))
		return resp, err
	}
}

// StreamServerInterceptor counts and times streaming gRPC calls, which
// include everything the UnknownServiceHandler forwarder serves.
func (m *Metrics) StreamServerInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		start := time.Now()
		err := handler(srv, ss)
		method := info.FullMethod
		if method == "" {
			method, _ = grpc.MethodFromServerStream(ss)
		}
		m.observe(SurfaceGRPC, GRPCMethodLabel(method), status.Code(err).String(), time.Since(start))
		return err
	}
}

// GRPCMethodLabel is the full method ("/pkg.Service/Method") when the method
// is in the process's protobuf registry, else "unknown": a forwarder accepts
// any name, and the label must stay bounded.
func GRPCMethodLabel(full string) string {
	if _, ok := knownMethods.Load(full); ok {
		return full
	}
	svc, method, ok := strings.Cut(strings.TrimPrefix(full, "/"), "/")
	if !ok || svc == "" || method == "" || strings.Contains(method, "/") {
		return unknownMethod
	}
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc + "." + method))
	if err != nil {
		return unknownMethod
	}
	if _, ok := d.(protoreflect.MethodDescriptor); !ok {
		return unknownMethod
	}
	knownMethods.Store(full, struct{}{})
	return full
}

// knownMethods are the full methods found in the registry so far, so that a
// call's label is one map read: bounded by the registry, as unknown names are
// not kept.
var knownMethods sync.Map
