package fleet

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/giantswarm/vm-manager/pkg/tracing"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
)

// NewDialer returns the Dialer of the fleet's node connections: TLS against
// the CA in caFile (each member's ServerName, else its address's host), or,
// without a CA, plaintext, which only loopback addresses may use (a test's
// nodes on one machine); the token would otherwise cross the network in the
// clear.
func NewDialer(caFile string) (Dialer, error) {
	var pool *x509.CertPool
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("fleet CA: %w", err)
		}
		pool = x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("fleet CA %s: no PEM certificate", caFile)
		}
	}
	return func(m Member) (*grpc.ClientConn, error) {
		host, _, err := net.SplitHostPort(m.Addr)
		if err != nil {
			return nil, fmt.Errorf("node %s address %q: %w", m.Name, m.Addr, err)
		}
		var creds credentials.TransportCredentials
		if pool != nil {
			name := m.ServerName
			if name == "" {
				name = host
			}
			creds = credentials.NewTLS(&tls.Config{RootCAs: pool, ServerName: name, MinVersion: tls.VersionTLS12})
		} else {
			if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
				return nil, fmt.Errorf("node %s at %s: without --fleet-ca-file only loopback node addresses are allowed", m.Name, m.Addr)
			}
			creds = insecure.NewCredentials()
		}
		opts := append([]grpc.DialOption{
			grpc.WithTransportCredentials(creds),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(mesh.MaxMessageBytes), grpc.MaxCallSendMsgSize(mesh.MaxMessageBytes)),
			grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: mesh.KeepaliveTime, Timeout: mesh.KeepaliveTimeout}),
			// A node back from a restart is picked up within about a second.
			grpc.WithConnectParams(grpc.ConnectParams{
				Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
				MinConnectTimeout: 2 * time.Second,
			}),
			grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				return invoker(forwardAuth(ctx), method, req, reply, cc, opts...)
			}),
			grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
				return streamer(forwardAuth(ctx), desc, cc, method, opts...)
			}),
		}, tracing.DialOptions()...)
		opts = append(opts, identity.ForwardDialOptions()...)
		return grpc.NewClient(m.Addr, opts...)
	}, nil
}

// forwardAuth passes the authorization the router's caller (the fleet
// gateway's own surfaces, which verified it) sent on to the node, whose
// gateway verifies it again.
func forwardAuth(ctx context.Context) context.Context {
	in, ok := metadata.FromIncomingContext(ctx)
	if !ok {
		return ctx
	}
	auth := in.Get(identity.AuthorizationKey)
	if len(auth) == 0 {
		return ctx
	}
	out, _ := metadata.FromOutgoingContext(ctx)
	out = out.Copy()
	out.Set(identity.AuthorizationKey, auth...)
	return metadata.NewOutgoingContext(ctx, out)
}
