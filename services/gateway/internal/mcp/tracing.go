package mcp

import (
	"context"
	"strings"

	"github.com/giantswarm/vm-manager/pkg/tracing"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.40.0"
	"go.opentelemetry.io/otel/trace"
)

// tracerName names the tracer of the MCP spans.
const tracerName = "github.com/giantswarm/vm-manager/services/gateway/internal/mcp"

// traced is a server span per MCP request, after OpenTelemetry's MCP
// conventions: "<method> <tool>" ("tools/call create_vm") with
// mcp.method.name, mcp.session.id and, for tools/call, gen_ai.tool.name
// and gen_ai.operation.name execute_tool; a tool error sets error.type
// tool_error. The SDK runs a request on its session's context, so the parent
// comes from the request: a traceparent in params._meta (the MCP
// convention) wins over the header, which carries the gateway's HTTP span
// (tracing.InHeader).
func traced(next mcp.MethodHandler) mcp.MethodHandler {
	tracer := otel.Tracer(tracerName)
	return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
		ctx = parent(ctx, req)
		name := method
		attrs := []attribute.KeyValue{semconv.McpMethodNameKey.String(method), semconv.NetworkTransportTCP, semconv.NetworkProtocolName("http")}
		if s := req.GetSession(); s != nil && s.ID() != "" {
			attrs = append(attrs, semconv.McpSessionID(s.ID()))
		}
		if call, ok := req.(*mcp.CallToolRequest); ok && call.Params != nil {
			name += " " + call.Params.Name
			attrs = append(attrs, semconv.GenAIToolName(call.Params.Name), semconv.GenAIOperationNameExecuteTool)
		}
		ctx, span := tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindServer), trace.WithAttributes(attrs...))
		defer span.End()
		res, err := next(ctx, method, req)
		switch r, _ := res.(*mcp.CallToolResult); {
		case err != nil:
			span.SetAttributes(semconv.ErrorTypeOther)
			span.SetStatus(codes.Error, err.Error())
		case r != nil && r.IsError:
			span.SetAttributes(semconv.ErrorTypeKey.String("tool_error"))
			span.SetStatus(codes.Error, toolErrorCode(r))
		}
		return res, err
	}
}

// parent is ctx with the span the request continues.
func parent(ctx context.Context, req mcp.Request) context.Context {
	if call, ok := req.(*mcp.CallToolRequest); ok && call.Params != nil {
		carrier := propagation.MapCarrier{}
		for _, k := range []string{"traceparent", "tracestate"} {
			if v, ok := call.Params.Meta[k].(string); ok {
				carrier[k] = v
			}
		}
		if carrier["traceparent"] != "" {
			if c := otel.GetTextMapPropagator().Extract(ctx, carrier); trace.SpanContextFromContext(c).IsValid() {
				return c
			}
		}
	}
	if extra := req.GetExtra(); extra != nil {
		return tracing.FromHeader(ctx, extra.Header)
	}
	return ctx
}

// toolErrorCode is the apierr code of a tool error's "<code>: <message>".
func toolErrorCode(r *mcp.CallToolResult) string {
	if len(r.Content) > 0 {
		if tc, ok := r.Content[0].(*mcp.TextContent); ok {
			if c, _, found := strings.Cut(tc.Text, ": "); found {
				return c
			}
		}
	}
	return "error"
}
