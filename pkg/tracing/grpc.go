package tracing

import (
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc/filters"
	"google.golang.org/grpc"
)

// traced leaves out health checks and reflection: probes and grpcurl's
// listings, not work.
var traced = filters.None(filters.HealthCheck(), filters.ServicePrefix("grpc.reflection."))

// ServerOptions are a gRPC server's span per call, continuing the caller's
// trace from the call's metadata (W3C traceparent); none while tracing is
// off.
func ServerOptions() []grpc.ServerOption {
	if !Enabled() {
		return nil
	}
	return []grpc.ServerOption{grpc.StatsHandler(otelgrpc.NewServerHandler(otelgrpc.WithFilter(traced)))}
}

// DialOptions are a gRPC client's span per call, whose context travels in
// the call's metadata; none while tracing is off.
func DialOptions() []grpc.DialOption {
	if !Enabled() {
		return nil
	}
	return []grpc.DialOption{grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithFilter(traced)))}
}
