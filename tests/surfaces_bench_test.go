package tests

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// surfaceCalls is how many sequential get_vm calls each surface gets per
// benchmark iteration; surfaceBlock of them run back to back before the next
// surface takes its turn, so a slow moment of the host hits all four alike.
const (
	surfaceCalls  = 2000
	surfaceBlock  = 100
	surfaceWarmup = 200
)

// BenchmarkSurfaces measures get_vm, one call at a time, over the four ways to
// reach it: directly on the hypervisor's unix socket (gRPC), gRPC through the
// gateway, REST and MCP (streamable HTTP, the official Go SDK). It prints p50,
// p99 and calls/s for each and their ratios to the direct call: the price of
// each surface. Two floors are measured with them, each a process of its own
// as the gateway is: the direct call through a byte relay (a loopback port
// copied to the hypervisor's socket: the second process crossing every
// gateway surface pays, without any protocol work), and MCP against the same
// SDK serving a get_vm that answers a fixed body (the SDK's own price). The
// VM is created with wait_for none and stopped before the clock starts, so no
// guest competes for the CPU; only its record is read. Run with a fixed
// count: go test -bench Surfaces -benchtime 1x (2000 calls per surface; Nx
// multiplies that). docs/performance.md#gateway-hop has the figures.
func BenchmarkSurfaces(b *testing.B) {
	images := cluster.GuestImages(b, "..")
	// Stop waits up to the stop timeout for the guest to power off: keep it
	// short, the guest is of no interest here.
	b.Setenv("VM_MANAGER_STOP_TIMEOUT", "2s")
	// At info, as deployed (and as the load test runs): debug writes a line
	// per MCP tool call, whose writing the bench would measure too.
	c := cluster.Start(b, cluster.Processes, binDir, cluster.Options{ImageDir: images, Quiet: true, LogLevel: "info"})
	base := "http://" + c.Addr + "/api/v1"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	code, _, body := cluster.Do(b, "POST", base+"/vms", `{"name":"surfaces","image":"test-guest","require_attestation":false,"memory_mib":384,"cpus":1,"wait_for":"none"}`)
	if code != http.StatusCreated {
		b.Fatalf("create: %d %s", code, body)
	}
	var vm vmJSON
	if err := json.Unmarshal(body, &vm); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		if code, _, body := cluster.Do(b, "DELETE", base+"/vms/"+vm.ID, ""); code != http.StatusNoContent {
			b.Errorf("delete: %d %s", code, body)
		}
	})
	if code, _, body = cluster.Do(b, "POST", base+"/vms/"+vm.ID+"/stop", ""); code != http.StatusOK {
		b.Fatalf("stop: %d %s", code, body)
	}
	if err := json.Unmarshal(body, &vm); err != nil {
		b.Fatal(err)
	}

	direct, err := grpc.NewClient("unix://"+c.Socket("hypervisor"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer direct.Close()
	relayed, err := grpc.NewClient(startHelper(b, "relay", c.Socket("hypervisor")), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer relayed.Close()
	gw, err := grpc.NewClient(c.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer gw.Close()
	rest := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
	defer rest.CloseIdleConnections()
	session, err := mcp.NewClient(&mcp.Implementation{Name: "vmm-bench", Version: "0"}, nil).
		Connect(ctx, &mcp.StreamableClientTransport{Endpoint: "http://" + c.Addr + "/mcp", MaxRetries: -1, DisableStandaloneSSE: true}, nil)
	if err != nil {
		b.Fatalf("mcp connect: %v", err)
	}
	defer session.Close()
	floorBody := filepath.Join(b.TempDir(), "vm.json")
	if err := os.WriteFile(floorBody, body, 0o600); err != nil {
		b.Fatal(err)
	}
	floor, err := mcp.NewClient(&mcp.Implementation{Name: "vmm-bench", Version: "0"}, nil).
		Connect(ctx, &mcp.StreamableClientTransport{Endpoint: "http://" + startHelper(b, "mcp", floorBody), MaxRetries: -1, DisableStandaloneSSE: true}, nil)
	if err != nil {
		b.Fatalf("mcp floor connect: %v", err)
	}
	defer floor.Close()
	mcpGet := func(session *mcp.ClientSession) func() error {
		return func() error {
			res, err := session.CallTool(ctx, &mcp.CallToolParams{Name: "get_vm", Arguments: map[string]any{"id": vm.ID}})
			if err != nil {
				return err
			}
			if text := mcpText(res); res.IsError || !strings.Contains(text, vm.ID) {
				return fmt.Errorf("tool error %t: %s", res.IsError, text)
			}
			return nil
		}
	}

	grpcGet := func(conn *grpc.ClientConn) func() error {
		hv := hypervisorv1.NewHypervisorServiceClient(conn)
		req := &hypervisorv1.GetVirtualMachineRequest{Id: vm.ID}
		return func() error {
			v, err := hv.GetVirtualMachine(ctx, req)
			if err == nil && v.GetId() != vm.ID {
				err = fmt.Errorf("got vm %q", v.GetId())
			}
			return err
		}
	}
	surfaces := []struct {
		name string
		call func() error
		lat  []time.Duration
		wall time.Duration
	}{
		{name: "direct (hypervisor.sock)", call: grpcGet(direct)},
		{name: "direct via a byte relay", call: grpcGet(relayed)},
		{name: "gRPC via gateway", call: grpcGet(gw)},
		{name: "REST", call: func() error {
			req, err := http.NewRequestWithContext(ctx, "GET", base+"/vms/"+vm.ID, nil)
			if err != nil {
				return err
			}
			resp, err := rest.Do(req)
			if err != nil {
				return err
			}
			body, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err == nil && (resp.StatusCode != http.StatusOK || !strings.Contains(string(body), vm.ID)) {
				err = fmt.Errorf("status %d: %s", resp.StatusCode, body)
			}
			return err
		}},
		{name: "MCP", call: mcpGet(session)},
		{name: "MCP floor (SDK, no work)", call: mcpGet(floor)},
	}
	for i := range surfaces {
		for range surfaceWarmup {
			if err := surfaces[i].call(); err != nil {
				b.Fatalf("%s warm-up: %v", surfaces[i].name, err)
			}
		}
	}

	n := surfaceCalls * b.N
	b.ResetTimer()
	for done := 0; done < n; done += surfaceBlock {
		for i := range surfaces {
			s := &surfaces[i]
			blockStart := time.Now()
			for range min(surfaceBlock, n-done) {
				start := time.Now()
				if err := s.call(); err != nil {
					b.Fatalf("%s: %v", s.name, err)
				}
				s.lat = append(s.lat, time.Since(start))
			}
			s.wall += time.Since(blockStart)
		}
	}
	b.StopTimer()

	type stats struct{ p50, p99, rate float64 } // µs, µs, calls/s
	res := make([]stats, len(surfaces))
	for i, s := range surfaces {
		res[i] = stats{
			p50:  micros(quantile(s.lat, 0.50)),
			p99:  micros(quantile(s.lat, 0.99)),
			rate: float64(len(s.lat)) / s.wall.Seconds(),
		}
	}
	keys := []string{"direct", "relay", "grpc", "rest", "mcp", "mcpfloor"}
	fmt.Printf("get_vm of a %s VM, %d sequential calls per surface, ratios to the direct call (and, for p50, to the direct call through a byte relay: the gateway's second process crossing without any protocol work):\n", vm.State, n)
	fmt.Printf("  %-26s %10s %10s %10s %10s %10s %10s %14s\n", "surface", "p50", "p99", "calls/s", "p50 ratio", "p50/relay", "p99 ratio", "calls/s ratio")
	for i, s := range surfaces {
		r, d, rl := res[i], res[0], res[1]
		fmt.Printf("  %-26s %8.0fµs %8.0fµs %10.0f %10.2f %10.2f %10.2f %14.2f\n", s.name, r.p50, r.p99, r.rate, r.p50/d.p50, r.p50/rl.p50, r.p99/d.p99, r.rate/d.rate)
		b.ReportMetric(r.p50, keys[i]+"-p50-µs")
		b.ReportMetric(r.p99, keys[i]+"-p99-µs")
		b.ReportMetric(r.rate, keys[i]+"-calls/s")
		if i > 0 {
			b.ReportMetric(r.p50/d.p50, keys[i]+"-p50-ratio")
			b.ReportMetric(r.rate/d.rate, keys[i]+"-calls/s-ratio")
		}
	}
	// The targets, each judged in this run, and where one is not
	// met, the floor measured beside it: what no gateway code can go below.
	ratio := func(i int) float64 { return res[i].p50 / res[0].p50 }
	relay, mcpFloor := ratio(1), ratio(5)
	fmt.Println("targets, p50 as a multiple of the direct call:")
	for _, t := range []struct {
		name   string
		got    float64
		target float64
		floor  float64
		why    string
	}{
		{"gRPC via gateway", ratio(2), 1.3, relay, "the byte relay alone (a second process crossing, no protocol work)"},
		{"REST", ratio(3), 1.8, relay, "the byte relay alone"},
		{"MCP", ratio(4), 3.0, mcpFloor, "the MCP SDK answering a fixed body, no backend call"},
	} {
		verdict := "met"
		if t.got > t.target {
			verdict = fmt.Sprintf("not met: %s already costs %.2f×, leaving %.2f× for the work itself", t.why, t.floor, t.got/t.floor)
		}
		fmt.Printf("  %-18s %.2f× (target ≤ %.1f×): %s\n", t.name, t.got, t.target, verdict)
	}
}

// helperEnv makes the test binary a helper process for the bench (init):
// "relay <socket>" copies the bytes of each connection to a loopback port to
// and from the unix socket, "mcp <file>" serves MCP (the same SDK, streamable
// HTTP) whose get_vm answers the file's content without any work. Either
// prints its address and serves until its stdin closes.
const helperEnv = "VMM_BENCH_HELPER"

func init() {
	if h := os.Getenv(helperEnv); h != "" {
		os.Exit(helper(h))
	}
}

// startHelper runs a helper as a process of its own, as the gateway is, and
// returns its address.
func startHelper(b *testing.B, mode, arg string) string {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"="+mode+" "+arg)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { stdin.Close(); _ = cmd.Wait() })
	addr, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		b.Fatalf("%s helper: %v", mode, err)
	}
	return strings.TrimSpace(addr)
}

func helper(h string) int {
	mode, arg, _ := strings.Cut(h, " ")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		return 1
	}
	fmt.Println(ln.Addr().String())
	go func() { _, _ = io.Copy(io.Discard, os.Stdin); os.Exit(0) }()
	switch mode {
	case "relay":
		for {
			c, err := ln.Accept()
			if err != nil {
				return 1
			}
			go func() {
				defer c.Close()
				u, err := net.Dial("unix", arg)
				if err != nil {
					return
				}
				defer u.Close()
				go func() { _, _ = io.Copy(u, c) }()
				_, _ = io.Copy(c, u)
			}()
		}
	case "mcp":
		body, err := os.ReadFile(arg)
		if err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			return 1
		}
		srv := mcp.NewServer(&mcp.Implementation{Name: "floor", Version: "0"}, nil)
		// The gateway's result: the body as text and as structured content.
		srv.AddTool(&mcp.Tool{Name: "get_vm", InputSchema: json.RawMessage(`{"type":"object"}`), OutputSchema: json.RawMessage(`{"type":"object"}`)}, func(context.Context, *mcp.CallToolRequest) (*mcp.CallToolResult, error) {
			return &mcp.CallToolResult{Content: []mcp.Content{&mcp.TextContent{Text: string(body)}}, StructuredContent: json.RawMessage(body)}, nil
		})
		h := mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return srv }, nil)
		_ = http.Serve(ln, h)
	}
	return 1
}

// quantile is the q-quantile of d (nearest rank).
func quantile(d []time.Duration, q float64) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	i := int(q*float64(len(s))+0.5) - 1
	return s[max(0, min(i, len(s)-1))]
}

func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// mcpText joins a tool result's text contents.
func mcpText(r *mcp.CallToolResult) string {
	var sb strings.Builder
	for _, c := range r.Content {
		if t, ok := c.(*mcp.TextContent); ok {
			sb.WriteString(t.Text)
		}
	}
	return sb.String()
}
