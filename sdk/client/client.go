// Package client dials vm-manager, the gateway's TCP address or a backend's
// unix socket, with the caller's bearer token on every call, and returns
// errors that sdk/apierr understands (apierr.CodeOf(err) == apierr.NotFound).
//
//	c, err := client.Dial("127.0.0.1:8080", client.WithToken(idToken))
//	vm, err := c.Hypervisor.GetVirtualMachine(ctx, &hypervisorv1.GetVirtualMachineRequest{Id: id})
package client

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"strings"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// Client holds one connection and the two public services on it.
type Client struct {
	Hypervisor  hypervisorv1.HypervisorServiceClient
	Attestation attestationv1.AttestationServiceClient
	conn        *grpc.ClientConn
}

// TokenSource returns the bearer token for a call (an OIDC id_token).
type TokenSource func(ctx context.Context) (string, error)

type options struct {
	token    TokenSource
	tls      *tls.Config
	insecure bool
	extra    []grpc.DialOption
}

// Option configures Dial.
type Option func(*options)

// WithToken sends a fixed bearer token on every call.
func WithToken(token string) Option {
	return WithTokenSource(func(context.Context) (string, error) { return token, nil })
}

// WithTokenSource asks for the token on every call (for refreshing tokens).
func WithTokenSource(ts TokenSource) Option { return func(o *options) { o.token = ts } }

// WithTLS uses TLS with cfg (a nil cfg means the system roots).
func WithTLS(cfg *tls.Config) Option {
	return func(o *options) {
		if cfg == nil {
			cfg = &tls.Config{MinVersion: tls.VersionTLS12}
		}
		o.tls = cfg
	}
}

// WithInsecureToken allows a token over plaintext to a non-loopback TCP
// address (a token on the wire in clear is refused by default).
func WithInsecureToken() Option { return func(o *options) { o.insecure = true } }

// WithDialOptions adds gRPC dial options.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.extra = append(o.extra, opts...) }
}

// Dial connects to target: "host:port" (the gateway) or "unix:///path" (a
// backend socket inside the pod). It does not block.
func Dial(target string, opts ...Option) (*Client, error) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	if o.token != nil && o.tls == nil && !o.insecure && !localTarget(target) {
		return nil, fmt.Errorf("client: refusing to send a bearer token in clear to %s: use WithTLS, or WithInsecureToken to accept that", target)
	}
	creds := insecure.NewCredentials()
	if o.tls != nil {
		creds = credentials.NewTLS(o.tls)
	}
	dopts := []grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithChainUnaryInterceptor(domainErrors),
		grpc.WithChainStreamInterceptor(domainStreamErrors),
	}
	if o.token != nil {
		dopts = append(dopts, grpc.WithPerRPCCredentials(bearer{source: o.token, secure: o.tls != nil}))
	}
	conn, err := grpc.NewClient(target, append(dopts, o.extra...)...)
	if err != nil {
		return nil, err
	}
	return &Client{
		Hypervisor:  hypervisorv1.NewHypervisorServiceClient(conn),
		Attestation: attestationv1.NewAttestationServiceClient(conn),
		conn:        conn,
	}, nil
}

// Conn is the underlying connection (for health checks or other stubs).
func (c *Client) Conn() *grpc.ClientConn { return c.conn }

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

// localTarget: unix sockets and loopback addresses, where a token in clear
// stays on the machine.
func localTarget(target string) bool {
	if strings.HasPrefix(target, "unix:") || strings.HasPrefix(target, "unix-abstract:") {
		return true
	}
	target = strings.TrimPrefix(target, "dns:///")
	target = strings.TrimPrefix(target, "passthrough:///")
	host, _, err := net.SplitHostPort(target)
	if err != nil {
		host = target
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

type bearer struct {
	source TokenSource
	secure bool
}

func (b bearer) GetRequestMetadata(ctx context.Context, _ ...string) (map[string]string, error) {
	tok, err := b.source(ctx)
	if err != nil {
		return nil, fmt.Errorf("client: token: %w", err)
	}
	if tok == "" {
		return nil, nil
	}
	return map[string]string{"authorization": "Bearer " + tok}, nil
}

// RequireTransportSecurity is false so that unix sockets and loopback work;
// Dial refuses clear text elsewhere.
func (b bearer) RequireTransportSecurity() bool { return false }

func domainErrors(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
	return toDomain(invoker(ctx, method, req, reply, cc, opts...))
}

func domainStreamErrors(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	s, err := streamer(ctx, desc, cc, method, opts...)
	return s, toDomain(err)
}

// toDomain turns a gRPC status into an *apierr.Error, keeping the status
// reachable with errors.As for callers that want it.
func toDomain(err error) error {
	if err == nil {
		return nil
	}
	var ae *apierr.Error
	if errors.As(err, &ae) {
		return err
	}
	return apierr.FromStatus(err)
}
