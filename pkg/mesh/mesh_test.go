package mesh_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/logging/logtest"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// shortDir returns a fresh directory with a short path, so socket paths stay
// under the 107-byte limit whatever TMPDIR is.
func shortDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("/tmp", "mesh")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

func TestListenModes(t *testing.T) {
	dir := filepath.Join(shortDir(t), "run")
	path := filepath.Join(dir, "h.sock")
	umask := os.FileMode(syscall.Umask(0o022))
	syscall.Umask(int(umask))
	l, err := mesh.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	fi, err := os.Stat(dir)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o700 {
		t.Errorf("dir mode = %o, want 700", fi.Mode().Perm())
	}
	si, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if si.Mode()&os.ModeSocket == 0 {
		t.Errorf("%s is not a socket: %v", path, si.Mode())
	}
	if si.Mode()&0o777 != 0o600 {
		t.Errorf("socket mode = %o, want 600", si.Mode()&0o777)
	}
	// The process umask is restored after Listen.
	f := filepath.Join(dir, "after")
	if err := os.WriteFile(f, nil, 0o666); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(f); fi.Mode().Perm() != 0o666&^umask {
		t.Errorf("file created after Listen has mode %o, want %o (umask %o)", fi.Mode().Perm(), 0o666&^umask, umask)
	}
}

func TestListenNarrowsExistingDir(t *testing.T) {
	dir := filepath.Join(shortDir(t), "wide")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	l, err := mesh.Listen(filepath.Join(dir, "a.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	fi, _ := os.Stat(dir)
	if fi.Mode().Perm() != 0o700 {
		t.Errorf("dir mode = %o, want 700", fi.Mode().Perm())
	}
}

func TestListenPathLength(t *testing.T) {
	dir := shortDir(t)
	mk := func(n int) string {
		p := dir + "/"
		return p + strings.Repeat("s", n-len(p))
	}
	long := mk(108)
	if _, err := mesh.Listen(long); err == nil || !strings.Contains(err.Error(), "108 bytes") || !strings.Contains(err.Error(), "107") {
		t.Errorf("108-byte path: err = %v", err)
	}
	if _, err := os.Lstat(long); !os.IsNotExist(err) {
		t.Errorf("108-byte path was created")
	}
	l, err := mesh.Listen(mk(107))
	if err != nil {
		t.Fatalf("107-byte path: %v", err)
	}
	l.Close()
}

func TestListenReplacesStaleSocket(t *testing.T) {
	path := filepath.Join(shortDir(t), "stale.sock")
	ul, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ul.SetUnlinkOnClose(false)
	ul.Close()
	if _, err := os.Lstat(path); err != nil {
		t.Fatalf("stale socket file missing: %v", err)
	}
	l, err := mesh.Listen(path)
	if err != nil {
		t.Fatalf("Listen over stale socket: %v", err)
	}
	defer l.Close()
	// The new socket accepts connections.
	done := make(chan error, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			c.Close()
		}
		done <- err
	}()
	c, err := net.DialTimeout("unix", path, time.Second)
	if err != nil {
		t.Fatalf("dial new socket: %v", err)
	}
	c.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestListenRefusesLiveSocket(t *testing.T) {
	path := filepath.Join(shortDir(t), "live.sock")
	first, err := mesh.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Close()
	go func() { // accept the probe connection
		for {
			c, err := first.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	_, err = mesh.Listen(path)
	if err == nil || !strings.Contains(err.Error(), "in use") {
		t.Fatalf("err = %v, want in use", err)
	}
	// The live socket was not removed.
	c, err := net.DialTimeout("unix", path, time.Second)
	if err != nil {
		t.Fatalf("first listener lost its socket: %v", err)
	}
	c.Close()
}

// testHypervisor returns a conflict from GetHost, panics in GetImage and
// answers GetVirtualMachine with its own unavailable.
type testHypervisor struct {
	hypervisorv1.UnimplementedHypervisorServiceServer
}

func (testHypervisor) GetHost(context.Context, *hypervisorv1.GetHostRequest) (*hypervisorv1.Host, error) {
	return nil, apierr.Errorf(apierr.Conflict, "x")
}

func (testHypervisor) GetImage(_ context.Context, req *hypervisorv1.GetImageRequest) (*hypervisorv1.Image, error) {
	if req.GetRef() == "ok" {
		return &hypervisorv1.Image{Id: "ok"}, nil
	}
	panic("handler exploded")
}

func (testHypervisor) GetVirtualMachine(context.Context, *hypervisorv1.GetVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return nil, apierr.Errorf(apierr.Unavailable, "no attestation service")
}

func (testHypervisor) GetNetwork(context.Context, *hypervisorv1.GetNetworkRequest) (*hypervisorv1.Network, error) {
	return nil, apierr.Invalidf("name", "bad name %q", "N")
}

func (testHypervisor) ListNetworks(context.Context, *hypervisorv1.ListNetworksRequest) (*hypervisorv1.ListNetworksResponse, error) {
	return nil, fmt.Errorf("plain failure")
}

// A hand-written streaming service, to exercise the stream interceptor.
var streamDesc = grpc.ServiceDesc{
	ServiceName: "meshtest.Streamer",
	HandlerType: (*any)(nil),
	Streams: []grpc.StreamDesc{
		{StreamName: "Fail", ServerStreams: true, Handler: func(any, grpc.ServerStream) error {
			return apierr.Errorf(apierr.NotFound, "no stream here")
		}},
		{StreamName: "Panic", ServerStreams: true, Handler: func(any, grpc.ServerStream) error {
			panic("stream exploded")
		}},
	},
}

func startServer(t *testing.T) (*mesh.Server, *grpc.ClientConn, *logtest.Buffer) {
	t.Helper()
	return startServerDial(t, func(path string) (*grpc.ClientConn, error) { return mesh.Dial(path) })
}

// startServerDial is startServer with the client connection from dial.
func startServerDial(t *testing.T, dial func(path string) (*grpc.ClientConn, error)) (*mesh.Server, *grpc.ClientConn, *logtest.Buffer) {
	t.Helper()
	path := filepath.Join(shortDir(t), mesh.HypervisorSocket)
	l, err := mesh.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	logs := &logtest.Buffer{}
	srv := mesh.NewServer(slog.New(slog.NewTextHandler(logs, nil)))
	hypervisorv1.RegisterHypervisorServiceServer(srv, testHypervisor{})
	srv.RegisterService(&streamDesc, struct{}{})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	conn, err := dial(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		conn.Close()
		srv.Stop()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return srv, conn, logs
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return c
}

func info(t *testing.T, err error) *errdetails.ErrorInfo {
	t.Helper()
	st, ok := status.FromError(err)
	if !ok {
		t.Fatalf("not a status: %v", err)
	}
	for _, d := range st.Details() {
		if i, ok := d.(*errdetails.ErrorInfo); ok {
			return i
		}
	}
	t.Fatalf("status %v has no ErrorInfo", st)
	return nil
}

func TestServerHealthAndReflection(t *testing.T) {
	srv, conn, _ := startServer(t)
	hc := healthpb.NewHealthClient(conn)
	svc := hypervisorv1.HypervisorService_ServiceDesc.ServiceName

	// Before SetServing the registered service is unknown to health.
	if _, err := hc.Check(ctx(t), &healthpb.HealthCheckRequest{Service: svc}); status.Code(err) != codes.NotFound {
		t.Errorf("Check(%s) before SetServing: %v, want NotFound", svc, err)
	}
	srv.SetServing()
	for _, name := range []string{"", svc} {
		resp, err := hc.Check(ctx(t), &healthpb.HealthCheckRequest{Service: name})
		if err != nil {
			t.Fatalf("Check(%q): %v", name, err)
		}
		if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Errorf("Check(%q) = %v, want SERVING", name, resp.GetStatus())
		}
	}
	infos := srv.GetServiceInfo()
	for _, name := range []string{"grpc.reflection.v1.ServerReflection", "grpc.health.v1.Health", svc} {
		if _, ok := infos[name]; !ok {
			t.Errorf("service %s not registered; have %v", name, keys(infos))
		}
	}
}

func keys(m map[string]grpc.ServiceInfo) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

func TestUnaryErrorsBecomeStatuses(t *testing.T) {
	_, conn, logs := startServer(t)
	client := hypervisorv1.NewHypervisorServiceClient(conn)

	_, err := client.GetHost(ctx(t), &hypervisorv1.GetHostRequest{})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("GetHost: %v, want FailedPrecondition", err)
	}
	if i := info(t, err); i.GetReason() != "conflict" || i.GetDomain() != "vm-manager" {
		t.Errorf("ErrorInfo = %v", i)
	}
	if got := status.Convert(err).Message(); got != "x" {
		t.Errorf("message = %q, want x", got)
	}
	if apierr.CodeOf(err) != apierr.Conflict {
		t.Errorf("CodeOf = %q", apierr.CodeOf(err))
	}

	_, err = client.GetNetwork(ctx(t), &hypervisorv1.GetNetworkRequest{})
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("GetNetwork: %v", err)
	}
	if i := info(t, err); i.GetReason() != "invalid_request" || i.GetMetadata()["field"] != "name" {
		t.Errorf("ErrorInfo = %v", i)
	}

	_, err = client.ListNetworks(ctx(t), &hypervisorv1.ListNetworksRequest{})
	if status.Code(err) != codes.Internal || info(t, err).GetReason() != "internal_error" {
		t.Errorf("ListNetworks: %v", err)
	}
	if !strings.Contains(logs.String(), "request failed") || !strings.Contains(logs.String(), "plain failure") {
		t.Errorf("internal error not logged: %s", logs.String())
	}

	// An unimplemented method still comes back as Unimplemented (unsupported).
	_, err = client.ListImages(ctx(t), &hypervisorv1.ListImagesRequest{})
	if status.Code(err) != codes.Unimplemented || apierr.CodeOf(err) != apierr.Unsupported {
		t.Errorf("ListImages: %v", err)
	}
}

func TestPanicBecomesInternalAndServerSurvives(t *testing.T) {
	srv, conn, logs := startServer(t)
	srv.SetServing()
	client := hypervisorv1.NewHypervisorServiceClient(conn)

	_, err := client.GetImage(ctx(t), &hypervisorv1.GetImageRequest{Ref: "boom"})
	if status.Code(err) != codes.Internal {
		t.Fatalf("GetImage: %v, want Internal", err)
	}
	if i := info(t, err); i.GetReason() != "internal_error" {
		t.Errorf("reason = %q", i.GetReason())
	}
	msg := status.Convert(err).Message()
	if !strings.Contains(msg, "/vmmanager.hypervisor.v1.HypervisorService/GetImage") || strings.Contains(msg, "exploded") {
		t.Errorf("message = %q, want the method and not the panic value", msg)
	}
	if !strings.Contains(logs.String(), "panic in handler") || !strings.Contains(logs.String(), "handler exploded") {
		t.Errorf("panic not logged: %s", logs.String())
	}

	// The server keeps serving.
	img, err := client.GetImage(ctx(t), &hypervisorv1.GetImageRequest{Ref: "ok"})
	if err != nil || img.GetId() != "ok" {
		t.Fatalf("GetImage after panic: %v %v", img, err)
	}
	if _, err := client.GetHost(ctx(t), &hypervisorv1.GetHostRequest{}); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("GetHost after panic: %v", err)
	}
	resp, err := healthpb.NewHealthClient(conn).Check(ctx(t), &healthpb.HealthCheckRequest{})
	if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("health after panic: %v %v", resp, err)
	}
}

func TestStreamErrorsBecomeStatuses(t *testing.T) {
	_, conn, logs := startServer(t)
	recv := func(method string) error {
		cs, err := conn.NewStream(ctx(t), &grpc.StreamDesc{ServerStreams: true}, "/meshtest.Streamer/"+method)
		if err != nil {
			return err
		}
		if err := cs.SendMsg(&healthpb.HealthCheckRequest{}); err != nil && err != io.EOF {
			return err
		}
		if err := cs.CloseSend(); err != nil {
			return err
		}
		return cs.RecvMsg(&healthpb.HealthCheckResponse{})
	}
	err := recv("Fail")
	if status.Code(err) != codes.NotFound || info(t, err).GetReason() != "not_found" {
		t.Errorf("Fail: %v", err)
	}
	err = recv("Panic")
	if status.Code(err) != codes.Internal || info(t, err).GetReason() != "internal_error" {
		t.Errorf("Panic: %v", err)
	}
	if !strings.Contains(logs.String(), "stream exploded") {
		t.Errorf("stream panic not logged: %s", logs.String())
	}
	if err := recv("Fail"); status.Code(err) != codes.NotFound {
		t.Errorf("Fail after panic: %v", err)
	}
}

func TestDialDownBackendFailsFastUnavailable(t *testing.T) {
	conn, err := mesh.Dial(filepath.Join(shortDir(t), "nobody.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	start := time.Now()
	_, err = healthpb.NewHealthClient(conn).Check(ctx(t), &healthpb.HealthCheckRequest{})
	if status.Code(err) != codes.Unavailable {
		t.Errorf("err = %v, want Unavailable", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("took %v, want fail-fast", d)
	}
}

func TestDefaultRunDir(t *testing.T) {
	t.Setenv("XDG_RUNTIME_DIR", "/run/user/1234")
	if got := mesh.DefaultRunDir(); got != "/run/user/1234/vm-manager" {
		t.Errorf("DefaultRunDir = %q", got)
	}
	t.Setenv("XDG_RUNTIME_DIR", "")
	want := filepath.Join(os.TempDir(), fmt.Sprintf("vm-manager-%d", os.Geteuid()))
	if os.Geteuid() == 0 {
		want = "/run/vm-manager"
	}
	if got := mesh.DefaultRunDir(); got != want {
		t.Errorf("DefaultRunDir = %q, want %q", got, want)
	}
}

func TestServeUntilDrainsAndRemovesTheSocket(t *testing.T) {
	path := filepath.Join(shortDir(t), mesh.AttestationSocket)
	l, err := mesh.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	srv := mesh.NewServer(slog.New(slog.NewTextHandler(io.Discard, nil)))
	srv.SetServing()
	runCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- srv.ServeUntil(runCtx, l) }()
	conn, err := mesh.Dial(path)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if resp, err := healthpb.NewHealthClient(conn).Check(ctx(t), &healthpb.HealthCheckRequest{}); err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Check while serving: %v, %v", resp.GetStatus(), err)
	}
	cancel()
	select {
	case err := <-served:
		if err != nil {
			t.Errorf("ServeUntil after cancel: %v, want nil", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("ServeUntil did not return after cancel")
	}
	if _, err := os.Lstat(path); !os.IsNotExist(err) {
		t.Errorf("socket %s left behind: %v", path, err)
	}

	// Serving that ends by itself is an error, returned as is.
	l, err = mesh.Listen(path)
	if err != nil {
		t.Fatal(err)
	}
	l.Close()
	if err := mesh.NewServer(slog.New(slog.NewTextHandler(io.Discard, nil))).ServeUntil(context.Background(), l); err == nil {
		t.Error("ServeUntil on a closed listener: nil error")
	}
}
