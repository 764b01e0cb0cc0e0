// Package mesh is the pod's internal gRPC fabric: unix sockets in one runtime
// directory (0700, sockets 0600), a server with health and reflection, and the
// one place where domain errors become gRPC statuses.
package mesh

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"syscall"
	"time"

	"github.com/giantswarm/vm-manager/pkg/tracing"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"
)

// MaxSocketPath is the longest unix socket path Linux accepts (sun_path less NUL).
const MaxSocketPath = 107

// Socket names inside the runtime directory.
const (
	HypervisorSocket  = "hypervisor.sock"
	AttestationSocket = "attestation.sock"
)

// VerifierSocket is attestation's VerifierService socket, in the state
// directory: the hypervisor and attestation share that directory, the
// gateway never has it, so nothing the gateway can reach acts without a
// caller's token.
const VerifierSocket = "verifier.sock"

// DefaultRunDir is $XDG_RUNTIME_DIR/vm-manager, else /run/vm-manager for root,
// else a per-user directory under the temp dir.
func DefaultRunDir() string {
	if d := os.Getenv("XDG_RUNTIME_DIR"); d != "" {
		return filepath.Join(d, "vm-manager")
	}
	if os.Geteuid() == 0 {
		return "/run/vm-manager"
	}
	return filepath.Join(os.TempDir(), fmt.Sprintf("vm-manager-%d", os.Geteuid()))
}

// Listen binds a unix socket at path: its directory is created (or narrowed)
// to 0700, the socket is 0600, and a stale socket left by a dead process is
// replaced while a live one is an error.
func Listen(path string) (net.Listener, error) {
	if len(path) > MaxSocketPath {
		return nil, fmt.Errorf("socket path %s is %d bytes, the limit is %d", path, len(path), MaxSocketPath)
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("runtime directory: %w", err)
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		return nil, fmt.Errorf("runtime directory: %w", err)
	}
	if _, err := os.Lstat(path); err == nil {
		c, derr := net.DialTimeout("unix", path, time.Second)
		if derr == nil {
			c.Close()
			return nil, fmt.Errorf("socket %s is in use by a running process", path)
		}
		if !errors.Is(derr, syscall.ECONNREFUSED) && !errors.Is(derr, syscall.ENOENT) {
			return nil, fmt.Errorf("socket %s: %w", path, derr)
		}
		if err := os.Remove(path); err != nil {
			return nil, fmt.Errorf("remove stale socket: %w", err)
		}
	}
	// The umask closes the window between bind and chmod.
	old := syscall.Umask(0o177)
	l, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	return l, nil
}

// MaxMessageBytes bounds one gRPC message on the mesh, both ways. gRPC's
// default of 4 MiB is below what the API accepts: a REST body may be 8 MiB
// (user_data, a quote with event logs), and a guest's 8 MiB report grows when
// it is re-encoded as a protobuf Struct.
const MaxMessageBytes = 64 << 20

// A peer that hangs rather than exits (stopped, wedged) still holds its
// socket, so calls to it would wait as long as their callers do. While a call
// is in flight the client pings after KeepaliveTime without a frame and
// gives the connection up when no answer comes within KeepaliveTimeout: the
// call fails with Unavailable, and so do the next ones until the peer
// answers again. Idle connections do not ping.
const (
	KeepaliveTime    = 10 * time.Second // gRPC's minimum
	KeepaliveTimeout = 5 * time.Second
)

// Flow-control windows, fixed. gRPC's default is a window that grows with the
// bandwidth-delay product it measures: on every message received a PING and a
// WINDOW_UPDATE, one more write and wakeup on each side per call, which is a
// third of a small call's cost on a unix socket, where there is no delay to
// measure. The stream window bounds a peer's unread data per call, the
// connection window per connection (gRPC's measured window may grow to 16 MiB).
const (
	StreamWindowBytes = 1 << 20
	ConnWindowBytes   = 4 << 20
)

// ServerTransportOptions are the fixed windows, and a goroutine per CPU that
// serves calls one after another: a new goroutine per call grows its stack
// from scratch every time (gRPC spawns one when all are busy).
func ServerTransportOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.InitialWindowSize(StreamWindowBytes),
		grpc.InitialConnWindowSize(ConnWindowBytes),
		grpc.NumStreamWorkers(uint32(runtime.NumCPU())),
	}
}

// DrainTimeout is how long a process finishes in-flight calls after SIGTERM
// before it cuts them off. A create_vm waiting for ready takes 10-15 s under
// TCG; the pod's grace period (90 s) also covers the hypervisor's power-down
// of its VMs (the stop timeout) after the drain.
const DrainTimeout = 30 * time.Second

// Server is a gRPC server with health and reflection.
type Server struct {
	*grpc.Server
	Health *health.Server
}

// NewServer returns a server whose handlers may return domain errors: they are
// converted to statuses with a google.rpc.ErrorInfo here, once. Panics become
// internal errors instead of killing the process. With tracing on, each call
// is a span continuing the caller's trace.
func NewServer(log *slog.Logger, extra ...grpc.ServerOption) *Server {
	opts := append([]grpc.ServerOption{
		grpc.MaxRecvMsgSize(MaxMessageBytes),
		grpc.MaxSendMsgSize(MaxMessageBytes),
		// Accept the clients' pings (Dial's keepalive); the default would
		// answer pings more often than every 5 minutes with GOAWAY.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: KeepaliveTime / 2}),
		grpc.ChainUnaryInterceptor(unaryErrors(log)),
		grpc.ChainStreamInterceptor(streamErrors(log)),
	}, append(ServerTransportOptions(), tracing.ServerOptions()...)...)
	s := grpc.NewServer(append(opts, extra...)...)
	h := health.NewServer()
	healthpb.RegisterHealthServer(s, h)
	reflection.Register(s)
	return &Server{Server: s, Health: h}
}

// SetServing marks every registered service, and the server as a whole, SERVING.
func (s *Server) SetServing() {
	for name := range s.GetServiceInfo() {
		s.Health.SetServingStatus(name, healthpb.HealthCheckResponse_SERVING)
	}
	s.Health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
}

// ServeUntil serves on ln until ctx is done, then drains: health turns
// NOT_SERVING, in-flight calls get DrainTimeout to finish before they are cut
// off, and the socket file (ln from Listen) is removed. It returns nil after
// the drain, or Serve's error when serving ends before ctx is done.
func (s *Server) ServeUntil(ctx context.Context, ln net.Listener) error {
	errc := make(chan error, 1)
	go func() { errc <- s.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	s.Health.Shutdown()
	stopped := make(chan struct{})
	go func() { s.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(DrainTimeout):
		s.Stop()
	}
	if a, ok := ln.Addr().(*net.UnixAddr); ok {
		_ = os.Remove(a.Name)
	}
	return nil
}

// ServeAll serves each server on its listener until ctx is done, as
// ServeUntil does; when one stops serving early, the others are drained too
// and its error is returned.
func ServeAll(ctx context.Context, servers map[*Server]net.Listener) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, len(servers))
	for s, ln := range servers {
		go func() {
			err := s.ServeUntil(ctx, ln)
			cancel()
			errc <- err
		}()
	}
	var first error
	for range servers {
		if err := <-errc; err != nil && first == nil {
			first = err
		}
	}
	return first
}

func unaryErrors(log *slog.Logger) grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
		defer converted(log, info.FullMethod, &err)
		return handler(ctx, req)
	}
}

func streamErrors(log *slog.Logger) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) (err error) {
		defer converted(log, info.FullMethod, &err)
		return handler(srv, ss)
	}
}

// converted, deferred by a handler, turns a panic into an internal error and
// the handler's error into its status.
func converted(log *slog.Logger, method string, err *error) {
	if r := recover(); r != nil {
		log.Error("panic in handler", "method", method, "panic", r, "stack", string(debug.Stack()))
		*err = apierr.Errorf(apierr.Internal, "internal error in %s", method)
	}
	*err = convert(log, method, *err)
}

func convert(log *slog.Logger, method string, err error) error {
	if err == nil {
		return nil
	}
	st := apierr.ToStatus(err)
	if c := apierr.CodeOf(err); c == apierr.Internal || c == apierr.VMFailed {
		log.Error("request failed", "method", method, "code", c, "error", err)
	}
	return st.Err()
}

// Dial returns a client for a backend's unix socket. The connection is lazy
// and retries with a short backoff, so a restarted backend is picked up within
// about a second; calls fail fast with Unavailable while it is down.
func Dial(path string, extra ...grpc.DialOption) (*grpc.ClientConn, error) {
	opts := append([]grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxMessageBytes), grpc.MaxCallSendMsgSize(MaxMessageBytes)),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: KeepaliveTime, Timeout: KeepaliveTimeout}),
		grpc.WithInitialWindowSize(StreamWindowBytes),
		grpc.WithInitialConnWindowSize(ConnWindowBytes),
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: 2 * time.Second,
		}),
	}, tracing.DialOptions()...)
	return grpc.NewClient("unix://"+path, append(opts, extra...)...)
}

// DialBackend is Dial for the backend called name ("hypervisor",
// "attestation"), whose callers pass its errors on to theirs: a failure of
// the connection itself becomes the domain error unavailable, "the <name>
// service is unavailable: <what gRPC said>", so every surface names the
// backend that is down in the same words (see Unreachable).
func DialBackend(path, name string, extra ...grpc.DialOption) (*grpc.ClientConn, error) {
	return Dial(path, append([]grpc.DialOption{
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			return Unreachable(ctx, name, invoker(ctx, method, req, reply, cc, opts...))
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			cs, err := streamer(ctx, desc, cc, method, opts...)
			if err != nil {
				return nil, Unreachable(ctx, name, err)
			}
			return &namedStream{ClientStream: cs, ctx: ctx, name: name}, nil
		}),
	}, extra...)...)
}

// Unreachable turns err, the outcome of a call on ctx to the backend called
// name, into the domain error unavailable "the <name> service is
// unavailable: <message>" when the call failed for want of a connection: a
// gRPC status that no vm-manager service sent (no vm-manager ErrorInfo) with
// the code Unavailable, or Canceled while the caller had not given up (the
// connection was closed under the call). Everything else is returned as it
// is: what a backend said itself (its own unavailable included) reaches the
// caller unchanged.
func Unreachable(ctx context.Context, name string, err error) error {
	st, ok := status.FromError(err)
	if err == nil || !ok || apierr.HasErrorInfo(err) {
		return err
	}
	switch st.Code() {
	case codes.Unavailable:
	case codes.Canceled:
		if ctx.Err() != nil {
			return err
		}
	default:
		return err
	}
	return apierr.ToStatus(apierr.Errorf(apierr.Unavailable, "the %s service is unavailable: %s", name, st.Message())).Err()
}

// namedStream applies Unreachable to a stream's errors.
type namedStream struct {
	grpc.ClientStream
	ctx  context.Context
	name string
}

func (s *namedStream) Header() (metadata.MD, error) {
	md, err := s.ClientStream.Header()
	return md, Unreachable(s.ctx, s.name, err)
}

func (s *namedStream) CloseSend() error {
	return Unreachable(s.ctx, s.name, s.ClientStream.CloseSend())
}

func (s *namedStream) SendMsg(m any) error {
	return Unreachable(s.ctx, s.name, s.ClientStream.SendMsg(m))
}

func (s *namedStream) RecvMsg(m any) error {
	return Unreachable(s.ctx, s.name, s.ClientStream.RecvMsg(m))
}
