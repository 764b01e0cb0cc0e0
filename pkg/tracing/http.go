package tracing

import (
	"context"
	"net/http"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// HTTP wraps h in a server span per request (otelhttp), continuing the
// caller's W3C trace context. Requests untraced says true of (probes,
// metrics) get none. route gives a request's route ("/api/v1/vms/{id}"):
// the span is "<method> <route>", low in cardinality, with http.route; the
// path itself is in url.path. While tracing is off, HTTP returns h.
func HTTP(h http.Handler, untraced func(*http.Request) bool, route func(*http.Request) string) http.Handler {
	if !Enabled() {
		return h
	}
	routed := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		trace.SpanFromContext(r.Context()).SetAttributes(semconv.HTTPRoute(route(r)))
		h.ServeHTTP(w, r)
	})
	return otelhttp.NewHandler(routed, "http",
		otelhttp.WithTracerProvider(otel.GetTracerProvider()),
		otelhttp.WithFilter(func(r *http.Request) bool { return untraced == nil || !untraced(r) }),
		otelhttp.WithSpanNameFormatter(func(_ string, r *http.Request) string { return Method(r) + " " + route(r) }),
	)
}

// Method is the request's method as a span name takes it: one of HTTP's,
// else "HTTP", so that a caller cannot make up span names.
func Method(r *http.Request) string {
	switch m := r.Method; m {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch,
		http.MethodDelete, http.MethodOptions, http.MethodConnect, http.MethodTrace:
		return m
	}
	return "HTTP"
}

// InHeader puts the request's span into the request's traceparent header
// (replacing the caller's, whose trace the span continues) for a handler
// that reads the headers but runs its work on another context: the MCP SDK
// hands tool calls the request's headers, not its context. While tracing
// is off it returns h.
func InHeader(h http.Handler) http.Handler {
	if !Enabled() {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if trace.SpanContextFromContext(r.Context()).IsValid() {
			r = r.Clone(r.Context())
			otel.GetTextMapPropagator().Inject(r.Context(), propagation.HeaderCarrier(r.Header))
		}
		h.ServeHTTP(w, r)
	})
}

// FromHeader is the context of the trace a request's headers carry (InHeader).
func FromHeader(ctx context.Context, h http.Header) context.Context {
	if h == nil {
		return ctx
	}
	return otel.GetTextMapPropagator().Extract(ctx, propagation.HeaderCarrier(h))
}
