package mcp

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/tracing"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/test/bufconn"
)

// traceparentTransport sends a caller's trace context on every request.
type traceparentTransport struct{ traceparent string }

func (p traceparentTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("traceparent", p.traceparent)
	return http.DefaultTransport.RoundTrip(r)
}

const (
	callerTrace = "4bf92f3577b34da6a3ce929d0e0e4736"
	callerSpan  = "00f067aa0ba902b7"
	metaSpan    = "b7ad6b7169203331"
)

// TestToolSpans: with tracing on, a tools/call is a server span "tools/call
// <tool>" with gen_ai.tool.name, under the gateway's HTTP span (which
// continues the caller's trace), and the backend calls it makes are its
// descendants; a traceparent in params._meta is the parent instead; a tool
// error is marked.
func TestToolSpans(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tracing.Use(sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp)))
	t.Cleanup(func() { tracing.Use(nil) })

	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer(tracing.ServerOptions()...)
	hypervisorv1.RegisterHypervisorServiceServer(gs, &fakeHypervisor{host: &hypervisorv1.Host{Hostname: "node1"}})
	attestationv1.RegisterAttestationServiceServer(gs, fakeAttestation{})
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	conn, err := grpc.NewClient("passthrough:///bufnet", append(tracing.DialOptions(),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	// As the gateway mounts it: the HTTP span, handed on in the header.
	h := tracing.HTTP(tracing.InHeader(New(hypervisorv1.NewHypervisorServiceClient(conn), attestationv1.NewAttestationServiceClient(conn), nil, nil)),
		nil, func(*http.Request) string { return "/mcp" })
	ts := httptest.NewServer(h)
	t.Cleanup(ts.Close)

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	client := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil)
	cs, err := client.Connect(ctx, &mcp.StreamableClientTransport{
		Endpoint:   ts.URL,
		HTTPClient: &http.Client{Transport: traceparentTransport{"00-" + callerTrace + "-" + callerSpan + "-01"}},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.Close() })
	exp.Reset()

	if res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "get_host"}); err != nil || res.IsError {
		t.Fatalf("get_host: %v %+v", err, res)
	}
	// The HTTP span ends when the handler returns, which may be just after
	// the client has read the response: wait for it (bounded).
	var spans tracetest.SpanStubs
	byID := map[trace.SpanID]tracetest.SpanStub{}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		spans = exp.GetSpans()
		byID = map[trace.SpanID]tracetest.SpanStub{}
		var call tracetest.SpanStub
		for _, s := range spans {
			byID[s.SpanContext.SpanID()] = s
			if s.Name == "tools/call get_host" {
				call = s
			}
		}
		// The backend's server span ends after its reply is sent, which
		// may be after the tool returned: wait for one in the call's trace.
		inTrace := slices.ContainsFunc(spans, func(s tracetest.SpanStub) bool {
			return s.Name == "vmmanager.hypervisor.v1.HypervisorService/GetHost" && s.SpanKind == trace.SpanKindServer &&
				s.SpanContext.TraceID() == call.SpanContext.TraceID()
		})
		if _, ok := byID[call.Parent.SpanID()]; ok && inTrace || time.Now().After(deadline) {
			break
		}
	}
	find := func(name string) tracetest.SpanStub {
		t.Helper()
		for _, s := range spans {
			if s.Name == name {
				return s
			}
		}
		t.Fatalf("no span %q in %d spans", name, len(spans))
		return tracetest.SpanStub{}
	}
	call := find("tools/call get_host")
	backend := find("vmmanager.hypervisor.v1.HypervisorService/GetHost")
	// Other POSTs of the session (the initialized notification) may end
	// after the reset, so the HTTP span is the one the call names as parent.
	httpSpan, ok := byID[call.Parent.SpanID()]
	if !ok || httpSpan.Name != "POST /mcp" || call.SpanKind != trace.SpanKindServer {
		t.Errorf("tools/call span: parent %v (%q), kind %v; want the POST /mcp span", call.Parent.SpanID(), httpSpan.Name, call.SpanKind)
	}
	if httpSpan.Parent.SpanID().String() != callerSpan || httpSpan.SpanContext.TraceID().String() != callerTrace {
		t.Errorf("HTTP span does not continue the caller's trace: parent %v", httpSpan.Parent)
	}
	attrs := map[string]string{}
	for _, kv := range call.Attributes {
		attrs[string(kv.Key)] = kv.Value.Emit()
	}
	for k, v := range map[string]string{"gen_ai.tool.name": "get_host", "mcp.method.name": "tools/call", "gen_ai.operation.name": "execute_tool"} {
		if attrs[k] != v {
			t.Errorf("%s = %q, want %q", k, attrs[k], v)
		}
	}
	if attrs["mcp.session.id"] == "" {
		t.Error("no mcp.session.id")
	}
	// The backend's server span descends from the tool's span. The client
	// span of the call has the same name and may end first: look at the
	// server ones.
	descends := false
	for _, b := range spans {
		if b.Name != backend.Name || b.SpanKind != trace.SpanKindServer {
			continue
		}
		for s := b; s.Parent.IsValid() && !descends; {
			if s.Parent.SpanID() == call.SpanContext.SpanID() {
				descends = true
			}
			if s = byID[s.Parent.SpanID()]; s.Name == "" {
				break
			}
		}
	}
	if !descends {
		t.Errorf("no backend span %q of kind server is under the tool's span", backend.Name)
	}

	// A traceparent in _meta is the tool span's parent; a tool error is marked.
	exp.Reset()
	params := &mcp.CallToolParams{Name: "get_vm", Arguments: map[string]any{"id": "ffffffff"}}
	params.SetMeta(map[string]any{"traceparent": "00-" + callerTrace + "-" + metaSpan + "-01"})
	if res, err := cs.CallTool(ctx, params); err != nil || !res.IsError {
		t.Fatalf("get_vm of a missing VM: %v %+v", err, res)
	}
	spans = exp.GetSpans()
	call = find("tools/call get_vm")
	if call.Parent.SpanID().String() != metaSpan {
		t.Errorf("tools/call parent %v, want the _meta span %s", call.Parent.SpanID(), metaSpan)
	}
	errType := ""
	for _, kv := range call.Attributes {
		if kv.Key == "error.type" {
			errType = kv.Value.Emit()
		}
	}
	if errType != "tool_error" || call.Status.Description != "not_found" {
		t.Errorf("tool error: error.type %q, status %+v", errType, call.Status)
	}
}
