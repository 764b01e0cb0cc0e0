package tracing_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/pkg/buildinfo"
	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/pkg/tracing"
	"github.com/giantswarm/vm-manager/pkg/tracing/tracingtest"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

var quiet = slog.New(slog.DiscardHandler)

// remoteParent is a sampled span of another process, as a traceparent brings it.
func remoteParent(t *testing.T) context.Context {
	t.Helper()
	ctx := otel.GetTextMapPropagator().Extract(context.Background(), propagation.MapCarrier{
		"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
	})
	if !trace.SpanContextFromContext(ctx).IsSampled() {
		t.Fatal("the traceparent did not parse: is the W3C propagator installed?")
	}
	return ctx
}

// TestExport sends spans to a receiver over each protocol, and checks the
// resource and which spans each kind of process records.
func TestExport(t *testing.T) {
	for _, protocol := range []string{tracing.ProtocolHTTP, tracing.ProtocolGRPC} {
		t.Run(protocol, func(t *testing.T) {
			rcv := tracingtest.Start(t)
			endpoint := rcv.HTTPEndpoint
			if protocol == tracing.ProtocolGRPC {
				endpoint = rcv.GRPCEndpoint
			}
			for _, entry := range []bool{true, false} {
				stop, err := tracing.Start(context.Background(), tracing.Config{Endpoint: endpoint, Protocol: protocol}, tracing.Gateway, entry, quiet)
				if err != nil {
					t.Fatal(err)
				}
				if !tracing.Enabled() || len(tracing.ServerOptions()) == 0 || len(tracing.DialOptions()) == 0 {
					t.Fatal("tracing on, but no instrumentation")
				}
				tr := otel.Tracer("test")
				prefix := map[bool]string{true: "entry ", false: "backend "}[entry]
				_, s := tr.Start(context.Background(), prefix+"root server", trace.WithSpanKind(trace.SpanKindServer))
				s.End()
				_, s = tr.Start(context.Background(), prefix+"root client", trace.WithSpanKind(trace.SpanKindClient))
				s.End()
				_, s = tr.Start(remoteParent(t), prefix+"continued", trace.WithSpanKind(trace.SpanKindServer))
				s.End()
				stop()
				if tracing.Enabled() {
					t.Fatal("still enabled after stop")
				}
			}
			got := map[string]tracingtest.Span{}
			for _, s := range rcv.Spans() {
				got[s.Name] = s
			}
			for name, want := range map[string]bool{
				"entry root server": true, "entry root client": false, "entry continued": true,
				"backend root server": false, "backend root client": false, "backend continued": true,
			} {
				if _, ok := got[name]; ok != want {
					t.Errorf("span %q exported: %v, want %v", name, ok, want)
				}
			}
			s := got["backend continued"]
			if s.TraceID != "4bf92f3577b34da6a3ce929d0e0e4736" || s.ParentID != "00f067aa0ba902b7" {
				t.Errorf("continued span: trace %s parent %s", s.TraceID, s.ParentID)
			}
			if s.Service != tracing.Gateway || s.Resource["service.version"] != buildinfo.Version || s.Resource["service.namespace"] != "vm-manager" {
				t.Errorf("resource %v", s.Resource)
			}
			if rcv.Requests(protocol) == 0 {
				t.Errorf("no export request over %s", protocol)
			}
		})
	}
}

// TestOff installs nothing: no provider, no instrumentation, h itself.
func TestOff(t *testing.T) {
	stop, err := tracing.Start(context.Background(), tracing.Config{}, tracing.Hypervisor, false, quiet)
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	if tracing.Enabled() || tracing.ServerOptions() != nil || tracing.DialOptions() != nil {
		t.Fatal("tracing off, but instrumentation")
	}
	h := &handler{}
	if tracing.HTTP(h, nil, nil) != http.Handler(h) || tracing.InHeader(h) != http.Handler(h) {
		t.Fatal("tracing off, but the handler is wrapped")
	}
	if _, ok := otel.GetTracerProvider().(*sdktrace.TracerProvider); ok {
		t.Fatal("an SDK provider is installed")
	}
}

type handler struct{ r *http.Request }

func (h *handler) ServeHTTP(_ http.ResponseWriter, r *http.Request) { h.r = r }

func TestInvalidConfig(t *testing.T) {
	for _, cfg := range []tracing.Config{
		{Endpoint: "localhost:4318"},
		{Endpoint: "ftp://collector:4318"},
		{Endpoint: "http://"},
		{Endpoint: "http://collector:4318?x=1"},
		{Endpoint: "http://collector:4317/v1", Protocol: tracing.ProtocolGRPC},
		{Endpoint: "http://collector:4318", Protocol: "http/json"},
	} {
		if stop, err := tracing.Start(context.Background(), cfg, tracing.Gateway, true, quiet); err == nil {
			stop()
			t.Errorf("%+v: no error", cfg)
		}
	}
	if tracing.Enabled() {
		t.Error("a refused configuration left tracing on")
	}
}

func TestFlags(t *testing.T) {
	parse := func(args ...string) tracing.Config {
		fs := cli.New("x serve", "")
		fs.SetOutput(io.Discard)
		cfg := tracing.Flags(fs)
		if err := fs.Parse(args, nil); err != nil {
			t.Fatal(err)
		}
		return cfg()
	}
	if c := parse(); c.Enabled() || c.Protocol != tracing.ProtocolHTTP {
		t.Errorf("default %+v", c)
	}
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel:4317")
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	if c := parse(); c.Endpoint != "http://otel:4317" || c.Protocol != "grpc" {
		t.Errorf("standard variables: %+v", c)
	}
	t.Setenv("VM_MANAGER_OTLP_ENDPOINT", "http://vmm:4318")
	t.Setenv("VM_MANAGER_OTLP_PROTOCOL", "http/protobuf")
	if c := parse(); c.Endpoint != "http://vmm:4318" || c.Protocol != "http/protobuf" {
		t.Errorf("our variables win: %+v", c)
	}
	if c := parse("--otlp-endpoint=https://flag:4318", "--otlp-protocol=grpc"); c.Endpoint != "https://flag:4318" || c.Protocol != "grpc" {
		t.Errorf("flags win: %+v", c)
	}
}

// TestHTTP: a span per request named after its route, continuing the
// caller's trace, none for the untraced; InHeader hands the span on in the
// traceparent header.
func TestHTTP(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	tracing.Use(tp)
	t.Cleanup(func() { tracing.Use(nil) })

	inner := &handler{}
	h := tracing.HTTP(tracing.InHeader(inner), func(r *http.Request) bool { return r.URL.Path == "/healthz" },
		func(r *http.Request) string { return strings.Replace(r.URL.Path, "/abc", "/{id}", 1) })
	for _, path := range []string{"/healthz", "/vms/abc"} {
		req := httptest.NewRequest("BREW", path, nil)
		req.Header.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
		h.ServeHTTP(httptest.NewRecorder(), req)
	}
	spans := exp.GetSpans()
	if len(spans) != 1 {
		t.Fatalf("%d spans, want 1 (none for /healthz): %v", len(spans), spans)
	}
	s := spans[0]
	if s.Name != "HTTP /vms/{id}" || s.SpanKind != trace.SpanKindServer || s.Parent.SpanID().String() != "00f067aa0ba902b7" {
		t.Errorf("span %q kind %v parent %v", s.Name, s.SpanKind, s.Parent.SpanID())
	}
	got := trace.SpanContextFromContext(tracing.FromHeader(context.Background(), inner.r.Header))
	if got.SpanID() != s.SpanContext.SpanID() || got.TraceID() != s.SpanContext.TraceID() {
		t.Errorf("the header hands on %v, want the HTTP span %v", got.SpanID(), s.SpanContext.SpanID())
	}
}
