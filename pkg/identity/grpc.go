package identity

import (
	"context"
	"strings"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
)

// AuthorizationKey is the gRPC metadata key of the caller's token.
const AuthorizationKey = "authorization"

// alwaysOpen are the services every gRPC server serves without a token:
// health (probes) and reflection (grpcurl list/describe).
var alwaysOpen = []string{
	"grpc.health.v1.Health",
	"grpc.reflection.v1.ServerReflection",
	"grpc.reflection.v1alpha.ServerReflection",
}

// isOpen reports whether a full method ("/pkg.Service/Method") is served
// without a token: health, reflection, and the services or full methods in
// extra.
func isOpen(fullMethod string, extra []string) bool {
	svc := strings.TrimPrefix(fullMethod, "/")
	if i := strings.LastIndex(svc, "/"); i >= 0 {
		svc = svc[:i]
	}
	for _, o := range alwaysOpen {
		if svc == o {
			return true
		}
	}
	for _, o := range extra {
		if svc == strings.TrimPrefix(o, "/") || fullMethod == o {
			return true
		}
	}
	return false
}

// authenticateGRPC verifies the "authorization" metadata of an incoming call.
func (v *Verifier) authenticateGRPC(ctx context.Context, fullMethod string) (context.Context, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	ctx, err := v.authenticate(ctx, md.Get(AuthorizationKey), fullMethod)
	if err != nil {
		return ctx, apierr.ToStatus(err).Err()
	}
	return ctx, nil
}

// UnaryServerInterceptor refuses unary calls without a valid token with
// codes.Unauthenticated (and a vm-manager ErrorInfo) and puts the caller on
// the handler's context. Health and reflection, and the services or full
// method names in open, need no token. A nil verifier passes everything.
func (v *Verifier) UnaryServerInterceptor(open ...string) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		if v == nil || isOpen(info.FullMethod, open) {
			return handler(ctx, req)
		}
		ctx, err := v.authenticateGRPC(ctx, info.FullMethod)
		if err != nil {
			return nil, err
		}
		return handler(ctx, req)
	}
}

// StreamServerInterceptor is UnaryServerInterceptor for streams, including a
// grpc.UnknownServiceHandler's (the gateway's forwarder).
func (v *Verifier) StreamServerInterceptor(open ...string) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		if v == nil || isOpen(info.FullMethod, open) {
			return handler(srv, ss)
		}
		ctx, err := v.authenticateGRPC(ss.Context(), info.FullMethod)
		if err != nil {
			return err
		}
		return handler(srv, &contextStream{ServerStream: ss, ctx: ctx})
	}
}

// ServerOptions are the two interceptors as server options, or none for a
// nil verifier.
func (v *Verifier) ServerOptions(open ...string) []grpc.ServerOption {
	if v == nil {
		return nil
	}
	return []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(v.UnaryServerInterceptor(open...)),
		grpc.ChainStreamInterceptor(v.StreamServerInterceptor(open...)),
	}
}

type contextStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *contextStream) Context() context.Context { return s.ctx }

// OutgoingContext returns ctx with the token the request on ctx was
// authenticated with as outgoing "authorization" metadata, so a call to a
// backend carries the caller's identity. Without a token ctx is returned as
// it is.
func OutgoingContext(ctx context.Context) context.Context {
	raw := BearerFromContext(ctx)
	if raw == "" {
		return ctx
	}
	md, _ := metadata.FromOutgoingContext(ctx)
	md = md.Copy()
	md.Set(AuthorizationKey, "Bearer "+raw)
	return metadata.NewOutgoingContext(ctx, md)
}

// forwardCaller is OutgoingContext unless the call already carries an
// authorization (grpc-gateway's REST calls and the forwarder set their own).
func forwardCaller(ctx context.Context) context.Context {
	if md, ok := metadata.FromOutgoingContext(ctx); ok && len(md.Get(AuthorizationKey)) > 0 {
		return ctx
	}
	return OutgoingContext(ctx)
}

// ForwardDialOptions make every call on a client connection carry the token
// of the request it is made for (OutgoingContext), so code that calls a
// backend while serving an authenticated request (the gateway's REST, MCP and
// forwarder) passes the caller on without doing anything itself. A call whose
// context already has an outgoing authorization keeps it.
func ForwardDialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			return invoker(forwardCaller(ctx), method, req, reply, cc, opts...)
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			return streamer(forwardCaller(ctx), desc, cc, method, opts...)
		}),
	}
}

// Bearer is per-RPC credentials carrying a fixed token, for clients (tests,
// tools) that call a backend or the gateway as one caller. It does not
// require transport security: the mesh is unix sockets and the gateway's
// plaintext listener is loopback unless an operator says otherwise.
type Bearer string

// GetRequestMetadata implements credentials.PerRPCCredentials.
func (b Bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{AuthorizationKey: "Bearer " + string(b)}, nil
}

// RequireTransportSecurity implements credentials.PerRPCCredentials.
func (Bearer) RequireTransportSecurity() bool { return false }
