package server

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"
)

// getSeen signals once a GET (the MCP client's standalone SSE stream) has
// been answered.
type getSeen chan struct{}

func (g getSeen) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := http.DefaultTransport.RoundTrip(r)
	if err == nil && r.Method == http.MethodGet && resp.StatusCode == http.StatusOK {
		select {
		case g <- struct{}{}:
		default:
		}
	}
	return resp, err
}

// slowExec is a hypervisor whose exec takes a second.
type slowExec struct {
	hypervisorv1.UnimplementedHypervisorServiceServer
	started chan struct{}
}

func (s slowExec) ExecVirtualMachine(ctx context.Context, _ *hypervisorv1.ExecVirtualMachineRequest) (*hypervisorv1.ExecVirtualMachineResponse, error) {
	s.started <- struct{}{}
	select {
	case <-time.After(time.Second):
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	return &hypervisorv1.ExecVirtualMachineResponse{Stdout: "slept"}, nil
}

// TestShutdownEndsMCPStreams: an MCP session's standalone SSE stream, a GET
// that never ends by itself, does not hold the drain up: the gateway stops
// without error once the session's tool calls in flight have completed,
// instead of after its drain timeout with an error. The stream ends only
// after those calls: a client may give its session up, calls included, when
// it loses the stream.
func TestShutdownEndsMCPStreams(t *testing.T) {
	for _, inflight := range []bool{false, true} {
		t.Run(map[bool]string{false: "idle session", true: "tool call in flight"}[inflight], func(t *testing.T) {
			dir := t.TempDir()
			started := make(chan struct{}, 1)
			ln, err := net.Listen("unix", dir+"/hypervisor.sock")
			if err != nil {
				t.Fatal(err)
			}
			gs := grpc.NewServer()
			hypervisorv1.RegisterHypervisorServiceServer(gs, slowExec{started: started})
			go func() { _ = gs.Serve(ln) }()
			t.Cleanup(gs.Stop)

			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			addrc := make(chan net.Addr, 1)
			done := make(chan error, 1)
			go func() {
				done <- Run(ctx, Config{
					Listen:            "127.0.0.1:0",
					HypervisorSocket:  dir + "/hypervisor.sock",
					AttestationSocket: dir + "/attestation.sock", // never dialled here
					Ready:             func(a net.Addr) { addrc <- a },
				}, slog.New(slog.DiscardHandler))
			}()
			var addr net.Addr
			select {
			case addr = <-addrc:
			case err := <-done:
				t.Fatalf("gateway: %v", err)
			case <-time.After(10 * time.Second):
				t.Fatal("gateway not serving within 10s")
			}

			seen := make(getSeen, 1)
			cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer ccancel()
			cs, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil).Connect(cctx, &mcp.StreamableClientTransport{
				Endpoint:   "http://" + addr.String() + "/mcp",
				HTTPClient: &http.Client{Transport: seen},
			}, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer cs.Close()
			select {
			case <-seen:
			case <-time.After(10 * time.Second):
				t.Fatal("the client opened no standalone SSE stream")
			}
			callErr := make(chan error, 1)
			if inflight {
				go func() {
					res, err := cs.CallTool(cctx, &mcp.CallToolParams{Name: "exec_vm", Arguments: map[string]any{"id": "0a1b2c3d", "command": []string{"sleep", "1"}}})
					if err == nil && (res.IsError || !strings.Contains(res.Content[0].(*mcp.TextContent).Text, "slept")) {
						err = &toolError{res}
					}
					callErr <- err
				}()
				<-started
			}

			start := time.Now()
			cancel()
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("gateway stopped with %v, want nil", err)
				}
				if d := time.Since(start); d > 5*time.Second {
					t.Errorf("gateway took %s to stop with an MCP session", d)
				}
			case <-time.After(40 * time.Second):
				t.Fatal("gateway did not stop within 40s")
			}
			if inflight {
				if err := <-callErr; err != nil {
					t.Errorf("the tool call in flight at the stop: %v", err)
				}
			}
		})
	}
}

type toolError struct{ res *mcp.CallToolResult }

func (e *toolError) Error() string {
	return "tool result: " + e.res.Content[0].(*mcp.TextContent).Text
}
