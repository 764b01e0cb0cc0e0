package mcp

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// ---- fake backends, served by a real gRPC server over bufconn ----

type fakeHypervisor struct {
	hypervisorv1.UnimplementedHypervisorServiceServer

	host *hypervisorv1.Host

	mu        sync.Mutex
	auth      []string // the authorization metadata of every call
	vm        *hypervisorv1.VirtualMachine
	createReq *hypervisorv1.CreateVirtualMachineRequest
	execReq   *hypervisorv1.ExecVirtualMachineRequest
	revision  uint64
	watchers  map[chan *hypervisorv1.WatchVirtualMachinesResponse]string // name filter
	// importImage serves ImportImage when set (imports_test.go).
	importImage func(*hypervisorv1.ImportImageRequest, grpc.ServerStreamingServer[hypervisorv1.ImportImageResponse]) error
}

// publishLocked hands a change of f.vm to the watchers of its name.
func (f *fakeHypervisor) publishLocked(prev hypervisorv1.State) {
	f.revision++
	for ch, name := range f.watchers {
		if name == "" || name == f.vm.GetName() {
			ch <- &hypervisorv1.WatchVirtualMachinesResponse{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_CHANGED, Revision: f.revision, Vm: proto.CloneOf(f.vm), PreviousState: prev}
		}
	}
}

// WatchVirtualMachines: the VM if it has the name, SYNCED, then its changes.
func (f *fakeHypervisor) WatchVirtualMachines(req *hypervisorv1.WatchVirtualMachinesRequest, stream hypervisorv1.HypervisorService_WatchVirtualMachinesServer) error {
	f.record(stream.Context())
	ch := make(chan *hypervisorv1.WatchVirtualMachinesResponse, 64)
	f.mu.Lock()
	var first []*hypervisorv1.WatchVirtualMachinesResponse
	if f.vm != nil && (req.GetName() == "" || req.GetName() == f.vm.GetName()) {
		first = append(first, &hypervisorv1.WatchVirtualMachinesResponse{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SNAPSHOT, Revision: f.revision, Vm: proto.CloneOf(f.vm)})
	}
	first = append(first, &hypervisorv1.WatchVirtualMachinesResponse{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED, Revision: f.revision})
	if f.watchers == nil {
		f.watchers = map[chan *hypervisorv1.WatchVirtualMachinesResponse]string{}
	}
	f.watchers[ch] = req.GetName()
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		delete(f.watchers, ch)
		f.mu.Unlock()
	}()
	for _, m := range first {
		if err := stream.Send(m); err != nil {
			return err
		}
	}
	for {
		select {
		case <-stream.Context().Done():
			return stream.Context().Err()
		case m := <-ch:
			if err := stream.Send(m); err != nil {
				return err
			}
		}
	}
}

func (f *fakeHypervisor) record(ctx context.Context) {
	md, _ := metadata.FromIncomingContext(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.auth = append(f.auth, md.Get("authorization")...)
}

func (f *fakeHypervisor) authSeen() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.auth)
}

func (f *fakeHypervisor) lastCreate() *hypervisorv1.CreateVirtualMachineRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.createReq
}

func (f *fakeHypervisor) lastExec() *hypervisorv1.ExecVirtualMachineRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.execReq
}

func notFound(format string, args ...any) error {
	return apierr.ToStatus(apierr.Errorf(apierr.NotFound, format, args...)).Err()
}

func (f *fakeHypervisor) GetHost(ctx context.Context, _ *hypervisorv1.GetHostRequest) (*hypervisorv1.Host, error) {
	f.record(ctx)
	return f.host, nil
}

func (f *fakeHypervisor) ListImages(ctx context.Context, _ *hypervisorv1.ListImagesRequest) (*hypervisorv1.ListImagesResponse, error) {
	f.record(ctx)
	return &hypervisorv1.ListImagesResponse{}, nil
}

func (f *fakeHypervisor) GetVirtualMachine(ctx context.Context, req *hypervisorv1.GetVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	f.record(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.vm == nil || f.vm.GetId() != req.GetId() {
		return nil, notFound("vm %q not found", req.GetId())
	}
	return proto.CloneOf(f.vm), nil
}

func (f *fakeHypervisor) ListVirtualMachines(ctx context.Context, _ *hypervisorv1.ListVirtualMachinesRequest) (*hypervisorv1.ListVirtualMachinesResponse, error) {
	f.record(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	resp := &hypervisorv1.ListVirtualMachinesResponse{}
	if f.vm != nil {
		resp.Vms = append(resp.Vms, proto.CloneOf(f.vm))
	}
	return resp, nil
}

func (f *fakeHypervisor) setState(s hypervisorv1.State) {
	f.mu.Lock()
	defer f.mu.Unlock()
	prev := f.vm.State
	f.vm.State = s
	f.publishLocked(prev)
}

// CreateVirtualMachine takes ~2.5 s: creating, then booting at 0.6 s, ready
// at 1.5 s, and returns at 2.5 s.
func (f *fakeHypervisor) CreateVirtualMachine(ctx context.Context, req *hypervisorv1.CreateVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	f.record(ctx)
	f.mu.Lock()
	f.createReq = proto.CloneOf(req)
	f.vm = &hypervisorv1.VirtualMachine{Id: "0a1b2c3d", Name: req.GetName(), State: hypervisorv1.State_STATE_CREATING, CreatedAt: timestamppb.Now()}
	f.publishLocked(hypervisorv1.State_STATE_UNSPECIFIED)
	f.mu.Unlock()
	if req.GetName() == "quick" {
		return f.GetVirtualMachine(ctx, &hypervisorv1.GetVirtualMachineRequest{Id: "0a1b2c3d"})
	}
	start := time.Now()
	for _, step := range []struct {
		at    time.Duration
		state hypervisorv1.State
	}{
		{600 * time.Millisecond, hypervisorv1.State_STATE_BOOTING},
		{1500 * time.Millisecond, hypervisorv1.State_STATE_READY},
		{2500 * time.Millisecond, hypervisorv1.State_STATE_READY},
	} {
		select {
		case <-time.After(time.Until(start.Add(step.at))):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		f.setState(step.state)
	}
	return f.GetVirtualMachine(ctx, &hypervisorv1.GetVirtualMachineRequest{Id: "0a1b2c3d"})
}

func (f *fakeHypervisor) DeleteVirtualMachine(ctx context.Context, req *hypervisorv1.DeleteVirtualMachineRequest) (*hypervisorv1.DeleteVirtualMachineResponse, error) {
	f.record(ctx)
	return &hypervisorv1.DeleteVirtualMachineResponse{Id: req.GetId(), Deleted: true}, nil
}

func (f *fakeHypervisor) DeleteNetwork(ctx context.Context, req *hypervisorv1.DeleteNetworkRequest) (*hypervisorv1.DeleteNetworkResponse, error) {
	f.record(ctx)
	return &hypervisorv1.DeleteNetworkResponse{Name: req.GetName(), Deleted: true}, nil
}

func (f *fakeHypervisor) ExecVirtualMachine(ctx context.Context, req *hypervisorv1.ExecVirtualMachineRequest) (*hypervisorv1.ExecVirtualMachineResponse, error) {
	f.record(ctx)
	f.mu.Lock()
	f.execReq = proto.CloneOf(req)
	f.mu.Unlock()
	return &hypervisorv1.ExecVirtualMachineResponse{Stdout: strings.Join(req.GetCommand(), " ") + "\n", ExitCode: 3}, nil
}

func (f *fakeHypervisor) GetVirtualMachineConsole(ctx context.Context, req *hypervisorv1.GetVirtualMachineConsoleRequest) (*hypervisorv1.GetVirtualMachineConsoleResponse, error) {
	f.record(ctx)
	return &hypervisorv1.GetVirtualMachineConsoleResponse{Id: req.GetId(), Lines: req.GetLines()}, nil
}

type fakeAttestation struct {
	attestationv1.UnimplementedAttestationServiceServer
}

func (fakeAttestation) GetVirtualMachineAttestation(_ context.Context, req *attestationv1.GetVirtualMachineAttestationRequest) (*attestationv1.Attestation, error) {
	if req.GetId() != "0a1b2c3d" {
		return nil, notFound("vm %q not found", req.GetId())
	}
	return &attestationv1.Attestation{Required: true}, nil
}

// ---- harness ----

type harness struct {
	hv      *fakeHypervisor
	conn    *grpc.ClientConn // to the fakes
	session *mcp.ClientSession
	rpcs    *rpcLog

	mu       sync.Mutex
	progress []*mcp.ProgressNotificationParams
	observed []string // tool calls the Observer saw: "<tool> <code>"
}

func (h *harness) progressSeen() []*mcp.ProgressNotificationParams {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.progress)
}

// rpcLog records every unary call the backends get: the method's name
// and its request.
type rpcLog struct {
	mu    sync.Mutex
	calls []rpcCall
}

type rpcCall struct {
	method string // "HypervisorService/GetHost"
	req    proto.Message
}

func (l *rpcLog) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	l.mu.Lock()
	svc, method, _ := strings.Cut(strings.TrimPrefix(info.FullMethod, "/"), "/")
	l.calls = append(l.calls, rpcCall{svc[strings.LastIndex(svc, ".")+1:] + "/" + method, req.(proto.Message)})
	l.mu.Unlock()
	return handler(ctx, req)
}

// last is the last call recorded.
func (l *rpcLog) last() rpcCall {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.calls) == 0 {
		return rpcCall{}
	}
	return l.calls[len(l.calls)-1]
}

// authTransport sets the Authorization header on every MCP HTTP request.
type authTransport struct{ token string }

func (a authTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", a.token)
	return http.DefaultTransport.RoundTrip(r)
}

const testToken = "Bearer test-token-123"

func newHarness(t testing.TB) *harness {
	t.Helper()
	hv := &fakeHypervisor{host: &hypervisorv1.Host{
		Hostname:         "node1",
		Kernel:           "6.12.0",
		Cpus:             8,
		MemoryBytes:      16 << 30,
		Kvm:              &hypervisorv1.Device{Path: "/dev/kvm", Accessible: true},
		Qemu:             &hypervisorv1.Tool{Found: true, Version: "9.2.0"},
		StorageProviders: []string{"io.systemd.StorageProvider.fs"},
		Ready:            false,
		Missing:          []string{"swtpm"},
	}}

	lis := bufconn.Listen(1 << 20)
	rpcs := &rpcLog{}
	gs := grpc.NewServer(grpc.UnaryInterceptor(rpcs.intercept))
	hypervisorv1.RegisterHypervisorServiceServer(gs, hv)
	attestationv1.RegisterAttestationServiceServer(gs, fakeAttestation{})
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })

	h := &harness{hv: hv, rpcs: rpcs, conn: conn}
	ts := httptest.NewServer(New(hypervisorv1.NewHypervisorServiceClient(conn), attestationv1.NewAttestationServiceClient(conn), nil,
		func(tool, code string, _ time.Duration) {
			h.mu.Lock()
			defer h.mu.Unlock()
			h.observed = append(h.observed, tool+" "+code)
		}))
	t.Cleanup(ts.Close)

	client := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, &mcp.ClientOptions{
		ProgressNotificationHandler: func(_ context.Context, req *mcp.ProgressNotificationClientRequest) {
			h.mu.Lock()
			defer h.mu.Unlock()
			h.progress = append(h.progress, req.Params)
		},
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cs, err := client.Connect(ctx, &mcp.StreamableClientTransport{
		Endpoint:   ts.URL,
		HTTPClient: &http.Client{Transport: authTransport{testToken}},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.Close() })
	h.session = cs
	return h
}

func (h *harness) call(t *testing.T, name string, args any) *mcp.CallToolResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	res, err := h.session.CallTool(ctx, &mcp.CallToolParams{Name: name, Arguments: args})
	if err != nil {
		t.Fatalf("CallTool %s: %v", name, err)
	}
	return res
}

func text(t *testing.T, res *mcp.CallToolResult) string {
	t.Helper()
	if len(res.Content) != 1 {
		t.Fatalf("want one content, got %d", len(res.Content))
	}
	tc, ok := res.Content[0].(*mcp.TextContent)
	if !ok {
		t.Fatalf("want text content, got %T", res.Content[0])
	}
	return tc.Text
}

func wantOK(t *testing.T, res *mcp.CallToolResult) string {
	t.Helper()
	s := text(t, res)
	if res.IsError {
		t.Fatalf("unexpected tool error: %s", s)
	}
	return s
}

func wantError(t *testing.T, res *mcp.CallToolResult, prefix string) string {
	t.Helper()
	s := text(t, res)
	if !res.IsError {
		t.Fatalf("want a tool error, got %s", s)
	}
	if !strings.HasPrefix(s, prefix) {
		t.Fatalf("error %q does not start with %q", s, prefix)
	}
	return s
}
