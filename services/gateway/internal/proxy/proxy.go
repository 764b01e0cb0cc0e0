// Package proxy forwards the public gRPC services to the backends unchanged:
// bytes in, bytes out, metadata (the caller's authorization) and statuses
// (with their ErrorInfo) passed through. Only the services named in the route
// table are reachable; the internal verifier is not among them.
package proxy

import (
	"context"
	"errors"
	"io"
	"slices"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// Frame is one undecoded message: the buffers gRPC read it into, passed on
// to the next write without a copy.
type Frame struct{ data mem.BufferSlice }

// Codec passes Frames through untouched and encodes everything else as
// protobuf, so the same server also serves health and reflection. Its name is
// "proto": on the wire nothing changes.
type Codec struct{}

var (
	_ encoding.CodecV2 = Codec{}
	// protoCodec is gRPC's own, registered by the grpc package.
	protoCodec = encoding.GetCodecV2("proto")
)

// Marshal hands a Frame's buffers over: gRPC frees them once written.
func (Codec) Marshal(v any) (mem.BufferSlice, error) {
	if f, ok := v.(*Frame); ok {
		data := f.data
		f.data = nil
		return data, nil
	}
	return protoCodec.Marshal(v)
}

// Unmarshal keeps a reference to the buffers, which gRPC frees on return.
func (Codec) Unmarshal(data mem.BufferSlice, v any) error {
	if f, ok := v.(*Frame); ok {
		data.Ref()
		f.data = data
		return nil
	}
	return protoCodec.Unmarshal(data, v)
}

func (Codec) Name() string { return "proto" }

// Routes maps a fully-qualified service name to the backend serving it: a
// connection from mesh.DialBackend, so that an unreachable backend fails a
// call as "the <name> service is unavailable" here as on REST and MCP.
type Routes map[string]grpc.ClientConnInterface

// Handler is a grpc.UnknownServiceHandler that forwards to the routes.
func Handler(routes Routes) grpc.StreamHandler { return DrainingHandler(routes, nil, nil) }

// DrainingHandler is Handler that ends the calls of the longLived methods
// (full names, "/pkg.Service/Method": streams that never end by themselves,
// such as a watch) with unavailable when drain ends, so that a shutdown does
// not wait for them; other calls finish as usual.
func DrainingHandler(routes Routes, drain context.Context, longLived []string) grpc.StreamHandler {
	unary := unaryMethods(routes)
	return func(_ any, ss grpc.ServerStream) error {
		method, ok := grpc.MethodFromServerStream(ss)
		if !ok {
			return status.Error(codes.Internal, "no method in stream")
		}
		svc := strings.TrimPrefix(method, "/")
		if i := strings.LastIndex(svc, "/"); i >= 0 {
			svc = svc[:i]
		}
		conn, ok := routes[svc]
		if !ok {
			return status.Errorf(codes.Unimplemented, "unknown service %s", svc)
		}
		// A backend that cannot be reached is named by the connection
		// (mesh.DialBackend); what a backend said passes unchanged.
		if drain != nil && slices.Contains(longLived, method) {
			ctx, cancel := context.WithCancel(ss.Context())
			defer cancel()
			defer context.AfterFunc(drain, cancel)()
			err := forward(&withContext{ss, ctx}, conn, method)
			if err != nil && drain.Err() != nil && ss.Context().Err() == nil {
				return status.Error(codes.Unavailable, "the gateway is shutting down; call again (a watch: with since_revision, the last revision received)")
			}
			return err
		}
		if unary[method] {
			return forwardUnary(ss, conn, method)
		}
		return forward(ss, conn, method)
	}
}

// withContext is a server stream with another context.
type withContext struct {
	grpc.ServerStream
	ctx context.Context
}

func (w *withContext) Context() context.Context { return w.ctx }

// outgoing is ctx with the caller's metadata as the backend call's, less
// the hop-by-hop and transport metadata the client library sets by itself.
func outgoing(ctx context.Context) context.Context {
	md, _ := metadata.FromIncomingContext(ctx) // a copy, ours to trim
	for k := range md {
		if strings.HasPrefix(k, ":") || strings.HasPrefix(k, "grpc-") || k == "content-type" || k == "user-agent" || k == "te" {
			delete(md, k)
		}
	}
	return metadata.NewOutgoingContext(ctx, md)
}

func forward(ss grpc.ServerStream, conn grpc.ClientConnInterface, method string) error {
	ctx, cancel := context.WithCancel(ss.Context())
	defer cancel()
	desc := &grpc.StreamDesc{ServerStreams: true, ClientStreams: true}
	cs, err := conn.NewStream(outgoing(ctx), desc, method, grpc.ForceCodecV2(Codec{}))
	if err != nil {
		return err
	}

	upErr := make(chan error, 1)
	go func() {
		for {
			f := &Frame{}
			if err := ss.RecvMsg(f); err != nil {
				if errors.Is(err, io.EOF) {
					upErr <- cs.CloseSend()
					return
				}
				cancel()
				upErr <- err
				return
			}
			if err := cs.SendMsg(f); err != nil {
				// The backend ended the call; its status comes from RecvMsg below.
				upErr <- nil
				return
			}
		}
	}()

	md, err := cs.Header()
	if err == nil && md != nil {
		if err := ss.SendHeader(md); err != nil {
			return err
		}
	}
	for {
		f := &Frame{}
		if err := cs.RecvMsg(f); err != nil {
			ss.SetTrailer(cs.Trailer())
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		if err := ss.SendMsg(f); err != nil {
			return err
		}
	}
}

// unaryMethods are the full names of the routed services' unary methods, as
// the protobuf registry knows them: they are forwarded as one call (Invoke)
// rather than as a stream, which saves the stream's second goroutine and its
// extra frames. A method the registry does not know takes the stream path.
func unaryMethods(routes Routes) map[string]bool {
	unary := map[string]bool{}
	for svc := range routes {
		d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
		if err != nil {
			continue
		}
		sd, ok := d.(protoreflect.ServiceDescriptor)
		if !ok {
			continue
		}
		for i := range sd.Methods().Len() {
			m := sd.Methods().Get(i)
			if !m.IsStreamingClient() && !m.IsStreamingServer() {
				unary["/"+svc+"/"+string(m.Name())] = true
			}
		}
	}
	return unary
}

// forwardUnary forwards a unary call: the one request frame, then the
// backend's header, response frame and trailer.
func forwardUnary(ss grpc.ServerStream, conn grpc.ClientConnInterface, method string) error {
	in := &Frame{}
	if err := ss.RecvMsg(in); err != nil {
		if errors.Is(err, io.EOF) {
			return status.Error(codes.Internal, "grpc: client streaming protocol violation: get <nil>, want <EOF>")
		}
		return err
	}
	out := &Frame{}
	var header, trailer metadata.MD
	err := conn.Invoke(outgoing(ss.Context()), method, in, out, grpc.ForceCodecV2(Codec{}), grpc.Header(&header), grpc.Trailer(&trailer))
	if len(header) > 0 {
		if err := ss.SendHeader(header); err != nil {
			return err
		}
	}
	ss.SetTrailer(trailer)
	if err != nil {
		return err
	}
	return ss.SendMsg(out)
}
