package server

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
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

// startGateway runs the gateway on a loopback port with its backends'
// sockets in dir until cancel; done gets what Run returned. configure, if
// given, changes the configuration first.
func startGateway(t testing.TB, dir string, configure ...func(*Config)) (addr string, cancel context.CancelFunc, done <-chan error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	addrc := make(chan net.Addr, 1)
	errc := make(chan error, 1)
	cfg := Config{
		Listen:            "127.0.0.1:0",
		HypervisorSocket:  dir + "/hypervisor.sock",
		AttestationSocket: dir + "/attestation.sock",
		Ready:             func(a net.Addr) { addrc <- a },
	}
	for _, f := range configure {
		f(&cfg)
	}
	go func() {
		errc <- Run(ctx, cfg, slog.New(slog.DiscardHandler))
	}()
	select {
	case a := <-addrc:
		return a.String(), cancel, errc
	case err := <-errc:
		cancel()
		t.Fatalf("gateway: %v", err)
	case <-time.After(10 * time.Second):
		cancel()
		t.Fatal("gateway not serving within 10s")
	}
	return "", nil, nil
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

			addr, cancel, done := startGateway(t, dir) // the attestation socket is never dialled here
			defer cancel()

			seen := make(getSeen, 1)
			cctx, ccancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer ccancel()
			cs, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil).Connect(cctx, &mcp.StreamableClientTransport{
				Endpoint:   "http://" + addr + "/mcp",
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

// TestBackendDownNamedOnEverySurface: with neither backend there, a call
// fails as unavailable naming its backend, in the same words on REST, gRPC
// and MCP (the gateway's connections say it, mesh.DialBackend).
func TestBackendDownNamedOnEverySurface(t *testing.T) {
	addr, cancel, done := startGateway(t, t.TempDir())
	t.Cleanup(func() { cancel(); <-done })
	cctx, ccancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer ccancel()

	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil).Connect(cctx, &mcp.StreamableClientTransport{Endpoint: "http://" + addr + "/mcp"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()

	for _, tc := range []struct {
		backend, path, tool string
		args                map[string]any
		grpcCall            func() error
	}{
		{"hypervisor", "/api/v1/host", "get_host", nil, func() error {
			_, err := hypervisorv1.NewHypervisorServiceClient(conn).GetHost(cctx, &hypervisorv1.GetHostRequest{})
			return err
		}},
		{"attestation", "/api/v1/vms/0a1b2c3d/attestation", "get_vm_attestation", map[string]any{"id": "0a1b2c3d"}, func() error {
			_, err := attestationv1.NewAttestationServiceClient(conn).GetVirtualMachineAttestation(cctx, &attestationv1.GetVirtualMachineAttestationRequest{Id: "0a1b2c3d"})
			return err
		}},
	} {
		want := "the " + tc.backend + " service is unavailable: "
		t.Run(tc.backend, func(t *testing.T) {
			resp, err := http.Get("http://" + addr + tc.path)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			var e struct {
				Error struct{ Code, Message string }
			}
			if resp.StatusCode != 503 || json.Unmarshal(b, &e) != nil || e.Error.Code != "unavailable" || !strings.HasPrefix(e.Error.Message, want) {
				t.Errorf("REST GET %s: %d %s", tc.path, resp.StatusCode, b)
			}
			if want := string(apierr.RESTBody(apierr.Errorf(apierr.Unavailable, "%s", e.Error.Message))); string(b) != want {
				t.Errorf("REST body %q, want the envelope %q", b, want)
			}

			err = tc.grpcCall()
			if status.Code(err) != codes.Unavailable || apierr.CodeOf(err) != apierr.Unavailable || !strings.HasPrefix(apierr.MessageOf(err), want) {
				t.Errorf("gRPC: %v", err)
			}
			if strings.Count(apierr.MessageOf(err), "service is unavailable") != 1 {
				t.Errorf("gRPC message %q: want the backend named once", apierr.MessageOf(err))
			}

			res, err := cs.CallTool(cctx, &mcp.CallToolParams{Name: tc.tool, Arguments: tc.args})
			if err != nil {
				t.Fatal(err)
			}
			if text := res.Content[0].(*mcp.TextContent).Text; !res.IsError || !strings.HasPrefix(text, "unavailable: "+want) {
				t.Errorf("MCP %s: %v %q", tc.tool, res.IsError, text)
			}
		})
	}
}
