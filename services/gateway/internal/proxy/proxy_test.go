package proxy

import (
	"context"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
)

// backend answers get_vm with the caller's authorization as the VM's name,
// a header and a trailer, or not_found with its ErrorInfo; the watch sends
// three events.
type backend struct {
	hypervisorv1.UnimplementedHypervisorServiceServer
}

func (backend) GetVirtualMachine(ctx context.Context, req *hypervisorv1.GetVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	_ = grpc.SetHeader(ctx, metadata.Pairs("x-backend-header", "h"))
	_ = grpc.SetTrailer(ctx, metadata.Pairs("x-backend-trailer", "t"))
	if req.GetId() == "missing" {
		return nil, apierr.ToStatus(apierr.Errorf(apierr.NotFound, "vm missing not found")).Err()
	}
	return &hypervisorv1.VirtualMachine{Id: req.GetId(), Name: strings.Join(md.Get("authorization"), ",") + "|" + strings.Join(md.Get("user-agent"), ",")}, nil
}

func (backend) WatchVirtualMachines(_ *hypervisorv1.WatchVirtualMachinesRequest, ss grpc.ServerStreamingServer[hypervisorv1.WatchVirtualMachinesResponse]) error {
	for range 3 {
		if err := ss.Send(&hypervisorv1.WatchVirtualMachinesResponse{}); err != nil {
			return err
		}
	}
	return nil
}

func serve(t *testing.T, s *grpc.Server) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = s.Serve(ln) }()
	t.Cleanup(s.Stop)
	return ln.Addr().String()
}

func dial(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	c, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestForward: unary calls (Invoke) and streams pass the caller's metadata
// (not the transport's), the backend's header, trailer, message and status
// with its ErrorInfo unchanged.
func TestForward(t *testing.T) {
	bs := grpc.NewServer()
	hypervisorv1.RegisterHypervisorServiceServer(bs, backend{})
	be := dial(t, serve(t, bs))
	gw := grpc.NewServer(grpc.UnknownServiceHandler(Handler(Routes{hypervisorv1.HypervisorService_ServiceDesc.ServiceName: be})), grpc.ForceServerCodecV2(Codec{}))
	hv := hypervisorv1.NewHypervisorServiceClient(dial(t, serve(t, gw)))
	if !unaryMethods(Routes{hypervisorv1.HypervisorService_ServiceDesc.ServiceName: be})[hypervisorv1.HypervisorService_GetVirtualMachine_FullMethodName] {
		t.Fatal("get_vm is not taken as unary")
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer tok")
	var header, trailer metadata.MD
	vm, err := hv.GetVirtualMachine(ctx, &hypervisorv1.GetVirtualMachineRequest{Id: "0a1b2c3d"}, grpc.Header(&header), grpc.Trailer(&trailer))
	if err != nil {
		t.Fatal(err)
	}
	if vm.GetId() != "0a1b2c3d" || !strings.HasPrefix(vm.GetName(), "Bearer tok|") || strings.Count(vm.GetName(), "grpc-go") != 1 {
		t.Errorf("backend saw %q: want the caller's token and one user-agent (the gateway's own)", vm.GetName())
	}
	if header.Get("x-backend-header")[0] != "h" || trailer.Get("x-backend-trailer")[0] != "t" {
		t.Errorf("header %v, trailer %v", header, trailer)
	}

	header, trailer = nil, nil
	_, err = hv.GetVirtualMachine(ctx, &hypervisorv1.GetVirtualMachineRequest{Id: "missing"}, grpc.Header(&header), grpc.Trailer(&trailer))
	if apierr.CodeOf(err) != apierr.NotFound || apierr.MessageOf(err) != "vm missing not found" || !apierr.HasErrorInfo(err) {
		t.Errorf("error %v: want not_found with its ErrorInfo", err)
	}
	if len(header.Get("x-backend-header")) != 1 || len(trailer.Get("x-backend-trailer")) != 1 {
		t.Errorf("on an error: header %v, trailer %v", header, trailer)
	}

	stream, err := hv.WatchVirtualMachines(ctx, &hypervisorv1.WatchVirtualMachinesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for {
		if _, err := stream.Recv(); err == io.EOF {
			break
		} else if err != nil {
			t.Fatal(err)
		}
		n++
	}
	if n != 3 {
		t.Errorf("watch: %d events, want 3", n)
	}
}
