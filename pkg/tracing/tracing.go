// Package tracing is OpenTelemetry tracing for vm-manager's processes: an
// OTLP exporter, off unless an endpoint is configured, W3C trace context on
// HTTP and in gRPC metadata, and the instrumentation (otelhttp, otelgrpc)
// the processes put on their servers and mesh clients.
//
// Off, nothing is installed: the global tracer provider stays OpenTelemetry's
// no-op one, and ServerOptions, DialOptions and HTTP add nothing, so a
// request pays for no instrumentation at all.
package tracing

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"time"

	"github.com/giantswarm/vm-manager/pkg/buildinfo"
	"github.com/giantswarm/vm-manager/pkg/cli"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Service names, the resource's service.name of each process.
const (
	Gateway     = "vm-manager-gateway"
	Hypervisor  = "vm-manager-hypervisor"
	Attestation = "vm-manager-attestation"
)

// OTLP protocols.
const (
	ProtocolHTTP = "http/protobuf"
	ProtocolGRPC = "grpc"
)

// Config is where a process sends its spans.
type Config struct {
	// Endpoint is the OTLP receiver's base URL, http:// (plain) or
	// https://: for http/protobuf the spans go to its path plus
	// /v1/traces, as with OTEL_EXPORTER_OTLP_ENDPOINT. Empty: tracing off.
	Endpoint string
	// Protocol is ProtocolHTTP (the default) or ProtocolGRPC.
	Protocol string
}

// Enabled says whether the configuration turns tracing on.
func (c Config) Enabled() bool { return c.Endpoint != "" }

// Flags defines --otlp-endpoint ($VM_MANAGER_OTLP_ENDPOINT) and
// --otlp-protocol ($VM_MANAGER_OTLP_PROTOCOL) on fs. The function it returns,
// called once fs is parsed, is the configuration; where neither the flag nor
// its variable is set, the standard OTEL_EXPORTER_OTLP_ENDPOINT and
// OTEL_EXPORTER_OTLP_PROTOCOL apply, as an OpenTelemetry operator injects
// them.
func Flags(fs *cli.FlagSet) func() Config {
	endpoint := fs.String("otlp-endpoint", "VM_MANAGER_OTLP_ENDPOINT", "", "OTLP receiver for traces, http://host:port or https://host:port (else $OTEL_EXPORTER_OTLP_ENDPOINT); empty: no tracing")
	protocol := fs.String("otlp-protocol", "VM_MANAGER_OTLP_PROTOCOL", "", "OTLP protocol: http/protobuf or grpc (else $OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf)")
	return func() Config {
		return Config{
			Endpoint: firstSet(*endpoint, os.Getenv("OTEL_EXPORTER_OTLP_ENDPOINT")),
			Protocol: firstSet(*protocol, os.Getenv("OTEL_EXPORTER_OTLP_PROTOCOL"), ProtocolHTTP),
		}
	}
}

func firstSet(vals ...string) string {
	for _, v := range vals {
		if v = strings.TrimSpace(v); v != "" {
			return v
		}
	}
	return ""
}

// enabled is set while a tracer provider is in use (Use).
var enabled atomic.Bool

// Enabled says whether this process traces. Servers and clients built
// while it is false carry no instrumentation.
func Enabled() bool { return enabled.Load() }

// Use installs tp as the global tracer provider, with the W3C trace context
// propagator, and turns the instrumentation on; nil turns it off again (the
// no-op provider and propagator). Tests use it with an in-memory exporter;
// Start uses it with the OTLP exporter.
func Use(tp trace.TracerProvider) {
	if tp == nil {
		enabled.Store(false)
		otel.SetTracerProvider(noop.NewTracerProvider())
		otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator())
		return
	}
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.TraceContext{})
	enabled.Store(true)
}

// Start turns tracing on for the process called service (Gateway,
// Hypervisor, Attestation) when cfg has an endpoint, and returns the
// function that stops it at exit, sending what is left within StopTimeout.
// Without an endpoint it does nothing and stop is a no-op.
//
// entry marks the process where requests enter vm-manager (the gateway): it
// starts traces for the requests it serves. The backends only continue
// traces: a span of theirs is recorded when its parent is, so their
// background work, probes and scrapes, which no traced request caused, make
// no traces. OTEL_TRACES_SAMPLER, when set, replaces this rule.
func Start(ctx context.Context, cfg Config, service string, entry bool, log *slog.Logger) (stop func(), err error) {
	if !cfg.Enabled() {
		return func() {}, nil
	}
	exp, err := newExporter(ctx, cfg)
	if err != nil {
		return nil, err
	}
	res, err := resource.Merge(resource.Default(), resource.NewWithAttributes(semconv.SchemaURL,
		semconv.ServiceName(service),
		semconv.ServiceVersion(buildinfo.Version),
		semconv.ServiceNamespace("vm-manager"),
	))
	if err != nil {
		return nil, fmt.Errorf("tracing resource: %w", err)
	}
	opts := []sdktrace.TracerProviderOption{sdktrace.WithBatcher(exp), sdktrace.WithResource(res)}
	if os.Getenv("OTEL_TRACES_SAMPLER") == "" {
		opts = append(opts, sdktrace.WithSampler(sampler(entry)))
	}
	tp := sdktrace.NewTracerProvider(opts...)
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		log.Warn("tracing", "error", err)
	}))
	Use(tp)
	log.Info("tracing on", "otlp_endpoint", cfg.Endpoint, "otlp_protocol", cfg.Protocol, "service", service)
	return func() {
		Use(nil)
		ctx, cancel := context.WithTimeout(context.Background(), StopTimeout)
		defer cancel()
		if err := tp.Shutdown(ctx); err != nil {
			log.Warn("tracing: the last spans were not sent", "error", err)
		}
	}, nil
}

// StopTimeout bounds the flush of the last spans at exit.
const StopTimeout = 5 * time.Second

// newExporter checks the endpoint here: the exporters would fall back to
// localhost on a URL they cannot parse, and say nothing.
func newExporter(ctx context.Context, cfg Config) (*otlptrace.Exporter, error) {
	u, err := url.Parse(cfg.Endpoint)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
		return nil, fmt.Errorf("otlp endpoint %q: want http://host:port or https://host:port", cfg.Endpoint)
	}
	switch cfg.Protocol {
	case ProtocolHTTP, "":
		opts := []otlptracehttp.Option{
			otlptracehttp.WithEndpoint(u.Host),
			otlptracehttp.WithURLPath(strings.TrimSuffix(u.Path, "/") + "/v1/traces"),
		}
		if u.Scheme == "http" {
			opts = append(opts, otlptracehttp.WithInsecure())
		}
		return otlptracehttp.New(ctx, opts...)
	case ProtocolGRPC:
		if u.Path != "" && u.Path != "/" {
			return nil, fmt.Errorf("otlp endpoint %q: grpc takes no path", cfg.Endpoint)
		}
		opts := []otlptracegrpc.Option{otlptracegrpc.WithEndpoint(u.Host)}
		if u.Scheme == "http" {
			opts = append(opts, otlptracegrpc.WithInsecure())
		}
		return otlptracegrpc.New(ctx, opts...)
	}
	return nil, fmt.Errorf("otlp protocol %q: want http/protobuf or grpc", cfg.Protocol)
}

// sampler records every trace the entry process starts for a request it
// serves (a root server span) and, everywhere, what continues a recorded
// trace; nothing else.
func sampler(entry bool) sdktrace.Sampler {
	root := sdktrace.NeverSample()
	if entry {
		root = serverRoots{}
	}
	return sdktrace.ParentBased(root)
}

// serverRoots samples root spans of kind server: requests from outside.
// A root client span is a call no request caused (a readiness probe's
// health check, a metrics scrape's telemetry read).
type serverRoots struct{}

func (serverRoots) ShouldSample(p sdktrace.SamplingParameters) sdktrace.SamplingResult {
	if p.Kind == trace.SpanKindServer {
		return sdktrace.AlwaysSample().ShouldSample(p)
	}
	return sdktrace.NeverSample().ShouldSample(p)
}

func (serverRoots) Description() string { return "ServerRootsOnly" }
