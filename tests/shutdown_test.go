package tests

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// drainGrace is how long a process may take to exit after SIGTERM here: the
// drain bound (mesh.DrainTimeout, 30 s) plus slack.
const drainGrace = 35 * time.Second

// TestGracefulShutdown sends SIGTERM to each of the three binaries while
// calls are in flight: those calls complete, new connections are refused,
// the process exits 0 within its grace. The hypervisor leaves its VMs
// running (--detach-vms-on-exit=true) for the next one to re-adopt; started
// with --detach-vms-on-exit=false (the pod) it powers them down: QEMU and
// swtpm gone, records stopped with the reason, and so after its next start.
func TestGracefulShutdown(t *testing.T) {
	images := cluster.GuestImages(t, "..")
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	g1 := a.vm("POST", "/vms", `{"name":"g1","image":"test-guest","require_attestation":false,"memory_mib":384,"cpus":1}`, 201)
	if g1.State != "ready" {
		t.Fatalf("g1: %s %s", g1.State, g1.LastError)
	}
	gw := grpcConn(t, c.Addr)
	direct := grpcConn(t, "unix://"+c.Socket("hypervisor"))
	var g2 vmJSON

	t.Run("gateway", func(t *testing.T) {
		// An idle MCP session keeps its standalone SSE stream open: it must
		// not hold the drain up.
		mcpConnect(t, c.Addr)
		session := mcpConnect(t, c.Addr)
		calls := inflight{}
		calls.run("REST exec sleep 2", func() error { return restExecSleep(ctx, a.base, g1.ID) })
		calls.run("gRPC exec sleep 2", func() error { return grpcExecSleep(ctx, gw, g1.ID) })
		calls.run("MCP exec_vm sleep 2", func() error {
			res, err := session.CallTool(ctx, &mcp.CallToolParams{Name: "exec_vm", Arguments: map[string]any{"id": g1.ID, "command": []string{"sleep", "2"}}})
			if err == nil && (res.IsError || !strings.Contains(mcpText(res), `"exitCode": 0`)) {
				err = fmt.Errorf("tool result %s", mcpText(res))
			}
			return err
		})
		calls.run("REST create_vm wait_for ready", func() error {
			code, body, err := restDo(ctx, "POST", a.base+"/vms", `{"name":"g2","image":"test-guest","require_attestation":false,"memory_mib":384,"cpus":1,"wait_for":"ready"}`)
			if err != nil {
				return err
			}
			if code != http.StatusCreated {
				return fmt.Errorf("status %d: %s", code, body)
			}
			if err := json.Unmarshal(body, &g2); err != nil || g2.State != "ready" {
				return fmt.Errorf("created %s: %v", body, err)
			}
			return nil
		})
		// The create is in flight once the hypervisor has its record.
		cluster.Eventually(t, 10*time.Second, "g2's record", func() error {
			r, err := hypervisorv1.NewHypervisorServiceClient(direct).ListVirtualMachines(ctx, &hypervisorv1.ListVirtualMachinesRequest{})
			if err == nil && len(r.GetVms()) < 2 {
				err = errors.New("not yet")
			}
			return err
		})
		time.Sleep(300 * time.Millisecond) // the execs reach the guest

		drained := sigterm(t, c, "gateway", func() {
			// While it drains, the listener is closed.
			cluster.Eventually(t, 2*time.Second, "gateway refusing connections", func() error {
				return refused("tcp", c.Addr)
			})
		})
		calls.wait(t)
		t.Logf("gateway drained in-flight calls and exited in %s", drained.Round(time.Millisecond))
		c.StartService("gateway")
		c.WaitReady(20 * time.Second)
	})
	if g2.ID == "" {
		t.Fatal("the create in flight during the gateway's stop did not complete")
	}

	t.Run("hypervisor", func(t *testing.T) {
		calls := inflight{}
		calls.run("REST exec sleep 2 (through the gateway)", func() error { return restExecSleep(ctx, a.base, g1.ID) })
		calls.run("gRPC exec sleep 2 (hypervisor.sock)", func() error { return grpcExecSleep(ctx, direct, g2.ID) })
		time.Sleep(500 * time.Millisecond)
		drained := sigterm(t, c, "hypervisor", func() {
			cluster.Eventually(t, 2*time.Second, "hypervisor.sock refusing connections", func() error {
				return refused("unix", c.Socket("hypervisor"))
			})
		})
		calls.wait(t)
		t.Logf("hypervisor drained in-flight calls and exited in %s", drained.Round(time.Millisecond))
		for _, v := range []vmJSON{g1, g2} {
			if !cluster.Running(v.Processes.Qemu.Pid) || !cluster.Running(v.Processes.Tpm.Pid) {
				t.Errorf("%s: qemu or swtpm ended with the hypervisor (detach is the default)", v.Name)
			}
		}
		c.StartService("hypervisor")
		c.WaitReady(20 * time.Second)
		for _, v := range []vmJSON{g1, g2} {
			now := a.get(v.ID)
			if now.State != "ready" || now.Processes == nil || now.Processes.Qemu.Pid != v.Processes.Qemu.Pid {
				t.Errorf("%s after the restart: %+v (qemu pid was %d)", v.Name, now, v.Processes.Qemu.Pid)
			}
		}
		if r := a.exec(g2.ID, "hostname"); r.Stdout != "g2\n" {
			t.Errorf("exec after re-adoption: %+v", r)
		}
	})

	t.Run("attestation", func(t *testing.T) {
		// Calls of a few milliseconds, back to back from eight callers
		// (through the gateway and on attestation.sock): at the signal some
		// are in flight. Each must succeed or, once the service is gone, be
		// refused as unavailable; none may be cut off.
		atDirect := grpcConn(t, "unix://"+c.Socket("attestation"))
		type result struct {
			start, end time.Time
			err        error
		}
		var (
			mu      sync.Mutex
			results []result
			stop    = make(chan struct{})
			wg      sync.WaitGroup
		)
		for i := range 8 {
			conn := gw
			if i%2 == 1 {
				conn = atDirect
			}
			client := attestationv1.NewAttestationServiceClient(conn)
			wg.Go(func() {
				for {
					select {
					case <-stop:
						return
					default:
					}
					start := time.Now()
					callCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
					var err error
					if i%4 < 2 {
						_, err = client.GetVirtualMachineAttestation(callCtx, &attestationv1.GetVirtualMachineAttestationRequest{Id: g1.ID})
					} else {
						_, err = client.ListImagePolicies(callCtx, &attestationv1.ListImagePoliciesRequest{})
					}
					cancel()
					mu.Lock()
					results = append(results, result{start, time.Now(), err})
					mu.Unlock()
					if err != nil {
						time.Sleep(20 * time.Millisecond)
					}
				}
			})
		}
		time.Sleep(500 * time.Millisecond)
		signalled := time.Now()
		drained := sigterm(t, c, "attestation", func() {
			cluster.Eventually(t, 2*time.Second, "attestation.sock refusing connections", func() error {
				return refused("unix", c.Socket("attestation"))
			})
		})
		close(stop)
		wg.Wait()
		overlapping, ok, failed := 0, 0, 0
		for _, r := range results {
			if r.err == nil {
				ok++
				if r.start.Before(signalled) && r.end.After(signalled) {
					overlapping++
				}
				continue
			}
			failed++
			if status.Code(r.err) != codes.Unavailable {
				t.Errorf("a call around the stop failed with %v, want success or unavailable", r.err)
			}
		}
		t.Logf("attestation exited in %s: %d calls succeeded (%d of them in flight at SIGTERM), %d refused as unavailable", drained.Round(time.Millisecond), ok, overlapping, failed)
		if overlapping == 0 {
			t.Errorf("no call was in flight at SIGTERM")
		}
		c.StartService("attestation")
		c.WaitReady(20 * time.Second)
		var att struct{ Boot int }
		getJSON(t, a.base+"/vms/"+g1.ID+"/attestation", &att)
		if att.Boot != 1 {
			t.Errorf("g1's attestation after the restart: %+v", att)
		}
	})

	t.Run("pod-style power-down", func(t *testing.T) {
		// Restart the hypervisor as the pod runs it: it re-adopts both VMs,
		// and its SIGTERM powers them down.
		if code := c.StopServiceGracefully("hypervisor", drainGrace); code != 0 {
			t.Fatalf("hypervisor exit code %d", code)
		}
		c.SetStopVMsOnExit(true)
		c.StartService("hypervisor")
		c.WaitReady(20 * time.Second)
		vms := []vmJSON{a.get(g1.ID), a.get(g2.ID)}
		for _, v := range vms {
			if v.State != "ready" || v.Processes == nil {
				t.Fatalf("%s not re-adopted: %+v", v.Name, v)
			}
		}
		start := time.Now()
		// The stop timeout (30 s) plus the drain.
		if code := c.StopServiceGracefully("hypervisor", 30*time.Second+drainGrace); code != 0 {
			t.Errorf("hypervisor exit code %d", code)
		}
		t.Logf("hypervisor powered %d VMs down and exited in %s", len(vms), time.Since(start).Round(time.Millisecond))
		for _, v := range vms {
			if cluster.Running(v.Processes.Qemu.Pid) || cluster.Running(v.Processes.Tpm.Pid) {
				t.Errorf("%s: qemu (%d) or swtpm (%d) still running after the hypervisor's exit", v.Name, v.Processes.Qemu.Pid, v.Processes.Tpm.Pid)
			}
		}
		c.SetStopVMsOnExit(false)
		c.StartService("hypervisor")
		c.WaitReady(20 * time.Second)
		for _, v := range vms {
			now := a.get(v.ID)
			if now.State != "stopped" || now.Processes != nil || !strings.Contains(now.LastError, "detach-vms-on-exit=false") {
				t.Errorf("%s after the next start: state %s, lastError %q, processes %+v; want stopped with the reason", v.Name, now.State, now.LastError, now.Processes)
			}
		}
	})
}

// sigterm stops a service with SIGTERM while during runs, checks it exits 0
// within drainGrace and returns how long it took.
func sigterm(t *testing.T, c *cluster.Cluster, name string, during func()) time.Duration {
	t.Helper()
	start := time.Now()
	code := make(chan int, 1)
	go func() { code <- c.StopServiceGracefully(name, drainGrace) }()
	time.Sleep(50 * time.Millisecond) // the signal is handled
	during()
	if got := <-code; got != 0 {
		t.Errorf("%s exited with %d after SIGTERM, want 0", name, got)
	}
	return time.Since(start)
}

// refused is nil when a new connection to addr is refused (or the socket is gone).
func refused(network, addr string) error {
	conn, err := net.DialTimeout(network, addr, time.Second)
	if err == nil {
		conn.Close()
		return fmt.Errorf("%s %s still accepts connections", network, addr)
	}
	if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) {
		return nil
	}
	return err
}

// inflight runs calls in the background and reports their outcome.
type inflight struct {
	wg   sync.WaitGroup
	mu   sync.Mutex
	errs []string
}

func (f *inflight) run(name string, call func() error) {
	f.wg.Go(func() {
		start := time.Now()
		if err := call(); err != nil {
			f.mu.Lock()
			f.errs = append(f.errs, fmt.Sprintf("%s (after %s): %v", name, time.Since(start).Round(time.Millisecond), err))
			f.mu.Unlock()
		}
	})
}

func (f *inflight) wait(t *testing.T) {
	t.Helper()
	f.wg.Wait()
	for _, e := range f.errs {
		t.Errorf("in-flight call failed: %s", e)
	}
}

func grpcConn(t *testing.T, target string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func mcpConnect(t *testing.T, addr string) *mcp.ClientSession {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "vmm-shutdown", Version: "0"}, nil).
		Connect(ctx, &mcp.StreamableClientTransport{Endpoint: "http://" + addr + "/mcp"}, nil)
	if err != nil {
		t.Fatalf("mcp connect: %v", err)
	}
	t.Cleanup(func() { cs.Close() })
	return cs
}

func restDo(ctx context.Context, method, url, body string) (int, []byte, error) {
	req, err := http.NewRequestWithContext(ctx, method, url, strings.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

func restExecSleep(ctx context.Context, base, id string) error {
	code, body, err := restDo(ctx, "POST", base+"/vms/"+id+"/exec", `{"command":["sleep","2"]}`)
	if err != nil {
		return err
	}
	var r execJSON
	if code != http.StatusOK || json.Unmarshal(body, &r) != nil || r.ExitCode != 0 {
		return fmt.Errorf("status %d: %s", code, body)
	}
	return nil
}

func grpcExecSleep(ctx context.Context, conn *grpc.ClientConn, id string) error {
	r, err := hypervisorv1.NewHypervisorServiceClient(conn).ExecVirtualMachine(ctx, &hypervisorv1.ExecVirtualMachineRequest{Id: id, Command: []string{"sleep", "2"}})
	if err == nil && r.GetExitCode() != 0 {
		err = fmt.Errorf("exit code %d: %s", r.GetExitCode(), r.GetStderr())
	}
	return err
}
