package server

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// oneVM is a hypervisor that knows one VM.
type oneVM struct {
	hypervisorv1.UnimplementedHypervisorServiceServer
	vm *hypervisorv1.VirtualMachine
}

func (o oneVM) GetVirtualMachine(context.Context, *hypervisorv1.GetVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return o.vm, nil
}

// BenchmarkHop is get_vm in one process: a hypervisor (mesh.NewServer, as the
// real one) answering from memory, called on its socket and through the
// gateway over gRPC, REST and MCP. All of it runs in the benchmark's process,
// so -cpuprofile sees the gateway's per-call work; tests/surfaces_bench_test.go
// measures the real binaries.
func BenchmarkHop(b *testing.B) {
	dir := b.TempDir()
	ln, err := mesh.Listen(dir + "/hypervisor.sock")
	if err != nil {
		b.Fatal(err)
	}
	hs := mesh.NewServer(slog.New(slog.DiscardHandler))
	vm := &hypervisorv1.VirtualMachine{Id: "0a1b2c3d", Name: "bench", State: hypervisorv1.State_STATE_STOPPED, MemoryMib: 384, Cpus: 1, Image: "test-guest"}
	hypervisorv1.RegisterHypervisorServiceServer(hs, oneVM{vm: vm})
	go func() { _ = hs.Serve(ln) }()
	b.Cleanup(hs.Stop)
	addr, cancel, done := startGateway(b, dir, func(c *Config) { c.MetricsEnabled = true })
	b.Cleanup(func() { cancel(); <-done })
	ctx := context.Background()

	grpcGet := func(target string) func(b *testing.B) {
		return func(b *testing.B) {
			conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Close()
			hv := hypervisorv1.NewHypervisorServiceClient(conn)
			req := &hypervisorv1.GetVirtualMachineRequest{Id: vm.Id}
			for b.Loop() {
				if v, err := hv.GetVirtualMachine(ctx, req); err != nil || v.GetId() != vm.Id {
					b.Fatalf("%v %v", v, err)
				}
			}
		}
	}
	b.Run("direct", cpuPerOp(grpcGet("unix://"+dir+"/hypervisor.sock")))
	b.Run("grpc", cpuPerOp(grpcGet(addr)))
	b.Run("rest", cpuPerOp(func(b *testing.B) {
		client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
		defer client.CloseIdleConnections()
		url := "http://" + addr + "/api/v1/vms/" + vm.Id
		for b.Loop() {
			resp, err := client.Get(url)
			if err != nil {
				b.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || !strings.Contains(string(body), vm.Id) {
				b.Fatalf("%d %s", resp.StatusCode, body)
			}
		}
	}))
	mcpGet := func(endpoint string) func(b *testing.B) {
		return func(b *testing.B) {
			session, err := mcp.NewClient(&mcp.Implementation{Name: "bench", Version: "0"}, nil).
				Connect(ctx, &mcp.StreamableClientTransport{Endpoint: endpoint, MaxRetries: -1, DisableStandaloneSSE: true}, nil)
			if err != nil {
				b.Fatal(err)
			}
			defer session.Close()
			for b.Loop() {
				res, err := session.CallTool(ctx, &mcp.CallToolParams{Name: "get_vm", Arguments: map[string]any{"id": vm.Id}})
				if err != nil || res.IsError {
					b.Fatalf("%v %v", res, err)
				}
			}
		}
	}
	b.Run("mcp", cpuPerOp(mcpGet("http://"+addr+"/mcp")))
	// The SDK's own price: a server whose get_vm answers a fixed body.
	floor := mcp.NewServer(&mcp.Implementation{Name: "floor", Version: "0"}, nil)
	floor.AddTool(&mcp.Tool{Name: "get_vm", InputSchema: json.RawMessage(`{"type":"object"}`)}, func(context.Context, *mcp.CallToolRequest) (*mcp.CallToolResult, error) {
		return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: `{"id": "0a1b2c3d", "name": "bench"}`}}}, nil
	})
	fs := httptest.NewServer(mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return floor }, nil))
	defer fs.Close()
	b.Run("mcp-floor", cpuPerOp(mcpGet(fs.URL)))
}

// cpuPerOp adds the process's CPU time (user and system, all goroutines:
// client, gateway and backend) per call, steadier than the wall time on a
// shared machine.
func cpuPerOp(f func(b *testing.B)) func(b *testing.B) {
	return func(b *testing.B) {
		before := cpuTime()
		f(b)
		b.ReportMetric(float64(cpuTime()-before)/float64(b.N), "cpu-ns/op")
	}
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
