package tests

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// fleetVM is a VM as the fleet answers it: with its node.
type fleetVM struct {
	vmJSON
	Node string `json:"node"`
}

// TestFleet: three nodes on this machine, each an attestation + hypervisor
// + gateway triple with its own state and a gateway serving TLS, behind a
// fleet gateway that finds them in a static list. A VM created on each
// node (two by name, one by placement), the list merged, get and exec
// routed by id, a policy imported once on every node, MCP's list_vms and
// get_host; then one node killed (partial lists naming it, its VM
// unavailable over REST and gRPC, the others fine) and back.
func TestFleet(t *testing.T) {
	images := cluster.GuestImages(t, "..")
	f := cluster.StartFleet(t, binDir, 3, cluster.Options{ImageDir: images}, func(i int) string {
		return map[int]string{0: "pool=a", 1: "pool=a", 2: "pool=b"}[i]
	})
	base := "http://" + f.Addr + "/api/v1"
	t.Cleanup(func() { killVMsAt(t, base) })

	// Two VMs by name at once, then one by placement: node-2 is the only
	// node without a VM, so it has the most free memory.
	vms := make([]fleetVM, 3)
	var wg sync.WaitGroup
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			vms[i] = createFleetVM(t, base, fmt.Sprintf(`{"name":"f%d","image":"test-guest","require_attestation":false,"memory_mib":384,"cpus":1,"node":"node-%d"}`, i, i))
		}()
	}
	wg.Wait()
	vms[2] = createFleetVM(t, base, `{"name":"f2","image":"test-guest","require_attestation":false,"memory_mib":384,"cpus":1}`)
	for i, v := range vms {
		if v.Node != f.Names[i] || !strings.HasPrefix(v.ID, fmt.Sprintf("%03x", i)) || v.State != "ready" {
			t.Fatalf("vm %d: id %s node %q state %s; want node %s, id prefix %03x, ready", i, v.ID, v.Node, v.State, f.Names[i], i)
		}
	}
	// A selector no node matches creates nothing, and says why.
	if code, _, b := cluster.Do(t, "POST", base+"/vms", `{"name":"nope","image":"test-guest","memory_mib":384,"cpus":1,"node_selector":"pool=c"}`); code != http.StatusTooManyRequests && code != http.StatusConflict && code != http.StatusServiceUnavailable && code != http.StatusBadRequest || !strings.Contains(string(b), "resource_exhausted") || !strings.Contains(string(b), "labels do not match") {
		t.Errorf("create with an unmatched selector: %d %s", code, b)
	}

	t.Run("list merged, get and exec routed", func(t *testing.T) {
		list, hdr := listFleet(t, base)
		if len(list) != 3 || hdr.Get("Warning") != "" {
			t.Fatalf("list: %d vms, Warning %q", len(list), hdr.Values("Warning"))
		}
		for _, v := range list {
			i := indexOfVM(vms, v.ID)
			if i < 0 || v.Node != f.Names[i] {
				t.Errorf("listed %s on %q", v.ID, v.Node)
			}
		}
		for i, v := range vms {
			var got fleetVM
			getJSON(t, base+"/vms/"+v.ID, &got)
			if got.Node != f.Names[i] || got.Name != v.Name {
				t.Errorf("get %s: %+v", v.ID, got)
			}
			code, _, b := cluster.Do(t, "POST", base+"/vms/"+v.ID+"/exec", `{"command":["cat","/proc/sys/kernel/hostname"]}`)
			if code != 200 || !strings.Contains(string(b), v.Name) {
				t.Errorf("exec on %s: %d %s", v.ID, code, b)
			}
		}
		// An id naming no node is not_found, without asking any.
		if code, _, b := cluster.Do(t, "GET", base+"/vms/fff00000", ""); code != 404 {
			t.Errorf("unknown index: %d %s", code, b)
		}
	})

	t.Run("policy imported once is on every node", func(t *testing.T) {
		if code, _, b := cluster.Do(t, "PUT", base+"/images/att-image_1.0.0/policy", attPolicy(strings.Repeat("f", 64))); code != 200 {
			t.Fatalf("import: %d %s", code, b)
		}
		for i, n := range f.Nodes {
			resp, err := f.Client.Get("https://" + n.Addr + "/api/v1/images/att-image_1.0.0/policy")
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || !strings.Contains(string(b), strings.Repeat("f", 64)) {
				t.Errorf("node %d policy: %d %s", i, resp.StatusCode, b)
			}
		}
	})

	t.Run("watch merges the nodes", func(t *testing.T) {
		lines := watchUntilSynced(t, base+"/vms:watch")
		snap := 0
		for _, l := range lines {
			if strings.Contains(l, `"vm"`) {
				snap++
			}
		}
		if snap != 3 {
			t.Errorf("watch: %d snapshots before synced, want 3:\n%s", snap, strings.Join(lines, "\n"))
		}
	})

	t.Run("mcp", func(t *testing.T) {
		cs := fleetMCP(t, f.Addr)
		res, err := cs.CallTool(context.Background(), &mcp.CallToolParams{Name: "list_vms", Arguments: map[string]any{}})
		if err != nil || res.IsError || len(res.Content) != 1 {
			t.Fatalf("list_vms: %v %+v", err, res)
		}
		for i, v := range vms {
			if !strings.Contains(res.Content[0].(*mcp.TextContent).Text, v.ID) {
				t.Errorf("list_vms misses vm %d", i)
			}
		}
		res, err = cs.CallTool(context.Background(), &mcp.CallToolParams{Name: "get_host", Arguments: map[string]any{}})
		if err != nil || res.IsError {
			t.Fatalf("get_host: %v %+v", err, res)
		}
		var host struct {
			Cpus       int
			FleetNodes []struct {
				Name      string
				Available bool
				Vms       int
			}
		}
		if err := json.Unmarshal([]byte(res.Content[0].(*mcp.TextContent).Text), &host); err != nil || len(host.FleetNodes) != 3 {
			t.Fatalf("get_host: %v %s", err, res.Content[0].(*mcp.TextContent).Text)
		}
		for i, n := range host.FleetNodes {
			if n.Name != f.Names[i] || !n.Available || n.Vms != 1 {
				t.Errorf("get_host line %d: %+v", i, n)
			}
		}
		res, err = cs.CallTool(context.Background(), &mcp.CallToolParams{Name: "get_host", Arguments: map[string]any{"node": "node-1"}})
		if err != nil || res.IsError || !strings.Contains(res.Content[0].(*mcp.TextContent).Text, `"nodeName": "node-1"`) {
			t.Errorf("get_host node-1: %v %+v", err, res)
		}
	})

	conn, err := grpc.NewClient(f.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hv := hypervisorv1.NewHypervisorServiceClient(conn)

	t.Run("streamed exec routed", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		st, err := hv.ExecVirtualMachineStream(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := st.Send(&hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_Start{
			Start: &hypervisorv1.ExecStart{Id: vms[2].ID, Command: []string{"cat", "/proc/sys/kernel/hostname"}}}}); err != nil {
			t.Fatal(err)
		}
		_ = st.CloseSend()
		var out strings.Builder
		for {
			m, err := st.Recv()
			if err != nil {
				t.Fatalf("stream: %v (stdout %q)", err, out.String())
			}
			out.Write(m.GetStdout())
			if m.GetExit() != nil {
				if m.GetExit().GetExitCode() != 0 || !strings.Contains(out.String(), "f2") {
					t.Errorf("streamed exec on node-2: exit %d, stdout %q", m.GetExit().GetExitCode(), out.String())
				}
				return
			}
		}
	})

	t.Run("exec WebSocket routed", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		c, _, err := websocket.Dial(ctx, "ws://"+f.Addr+"/api/v1/vms/"+vms[0].ID+"/exec/ws", &websocket.DialOptions{Subprotocols: []string{"vmm.exec.v1"}})
		if err != nil {
			t.Fatal(err)
		}
		defer c.CloseNow()
		if err := c.Write(ctx, websocket.MessageText, []byte(`{"start":{"command":["cat","/proc/sys/kernel/hostname"]}}`)); err != nil {
			t.Fatal(err)
		}
		var stdout strings.Builder
		for {
			typ, data, err := c.Read(ctx)
			if err != nil {
				t.Fatalf("read: %v (stdout %q)", err, stdout.String())
			}
			if typ == websocket.MessageBinary && len(data) > 0 && data[0] == 1 {
				stdout.Write(data[1:])
				continue
			}
			if typ == websocket.MessageText {
				if !strings.Contains(string(data), "exit") || !strings.Contains(stdout.String(), "f0") {
					t.Errorf("exec WebSocket on node-0: %s, stdout %q", data, stdout.String())
				}
				return
			}
		}
	})

	// A fleet watch open across the outage says so, naming the node.
	watch := watchLines(t, base+"/vms:watch")

	t.Run("a node down", func(t *testing.T) {
		f.StopNode(1)
		watch.waitFor(t, "node-1", "warning")
		list, hdr := listFleet(t, base)
		if len(list) != 2 || !strings.Contains(strings.Join(hdr.Values("Warning"), " "), "node-1") {
			t.Errorf("list with node-1 down: %d vms, Warning %q", len(list), hdr.Values("Warning"))
		}
		resp, err := hv.ListVirtualMachines(context.Background(), &hypervisorv1.ListVirtualMachinesRequest{})
		if err != nil || len(resp.GetVms()) != 2 || len(resp.GetWarnings()) != 1 || !strings.Contains(resp.GetWarnings()[0], "node-1") {
			t.Errorf("gRPC list with node-1 down: %v %d vms, warnings %q", err, len(resp.GetVms()), resp.GetWarnings())
		}
		for _, path := range []string{"GET /vms/" + vms[1].ID, "POST /vms/" + vms[1].ID + "/exec"} {
			method, p, _ := strings.Cut(path, " ")
			body := ""
			if method == "POST" {
				body = `{"command":["true"]}`
			}
			code, _, b := cluster.Do(t, method, base+p, body)
			if code != 503 || !strings.Contains(string(b), "unavailable") || !strings.Contains(string(b), "node-1") {
				t.Errorf("%s with node-1 down: %d %s", path, code, b)
			}
		}
		if _, err := hv.GetVirtualMachine(context.Background(), &hypervisorv1.GetVirtualMachineRequest{Id: vms[1].ID}); status.Code(err) != codes.Unavailable {
			t.Errorf("gRPC get with node-1 down: %v", err)
		}
		// The others carry on.
		for _, i := range []int{0, 2} {
			code, _, b := cluster.Do(t, "POST", base+"/vms/"+vms[i].ID+"/exec", `{"command":["true"]}`)
			if code != 200 {
				t.Errorf("exec on node-%d with node-1 down: %d %s", i, code, b)
			}
		}
		cs := fleetMCP(t, f.Addr)
		res, err := cs.CallTool(context.Background(), &mcp.CallToolParams{Name: "list_vms", Arguments: map[string]any{}})
		if err != nil || res.IsError || len(res.Content) != 2 || !strings.Contains(res.Content[1].(*mcp.TextContent).Text, "node-1") {
			t.Errorf("mcp list_vms with node-1 down: %v %+v", err, res)
		}
	})

	t.Run("the node back", func(t *testing.T) {
		f.StartNode(1)
		watch.waitFor(t, "node-1 is back")
		cluster.Eventually(t, 30*time.Second, "node-1 in the list", func() error {
			list, hdr := listFleet(t, base)
			if len(list) != 3 || hdr.Get("Warning") != "" {
				return fmt.Errorf("%d vms, Warning %q", len(list), hdr.Values("Warning"))
			}
			return nil
		})
		v, err := hv.GetVirtualMachine(context.Background(), &hypervisorv1.GetVirtualMachineRequest{Id: vms[1].ID})
		if err != nil || v.GetNode() != "node-1" {
			t.Errorf("gRPC get after the restart: %v %v", err, v.GetNode())
		}
		code, _, b := cluster.Do(t, "POST", base+"/vms/"+vms[1].ID+"/exec", `{"command":["true"]}`)
		if code != 200 {
			t.Errorf("exec after the restart: %d %s", code, b)
		}
	})
}

func createFleetVM(t *testing.T, base, body string) fleetVM {
	t.Helper()
	code, _, b := cluster.Do(t, "POST", base+"/vms", body)
	var v fleetVM
	if code != 201 || json.Unmarshal(b, &v) != nil {
		t.Errorf("create %s: %d %s", body, code, b)
	}
	return v
}

func listFleet(t *testing.T, base string) ([]fleetVM, http.Header) {
	t.Helper()
	code, hdr, b := cluster.Do(t, "GET", base+"/vms", "")
	var list []fleetVM
	if code != 200 || json.Unmarshal(b, &list) != nil {
		t.Fatalf("list: %d %s", code, b)
	}
	return list, hdr
}

func indexOfVM(vms []fleetVM, id string) int {
	for i, v := range vms {
		if v.ID == id {
			return i
		}
	}
	return -1
}

// watchUntilSynced reads a watch's JSON lines up to its synced message.
func watchUntilSynced(t *testing.T, url string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var lines []string
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if strings.Contains(strings.ToLower(sc.Text()), "synced") {
			return lines
		}
	}
	t.Fatalf("watch ended before synced: %v\n%s", sc.Err(), strings.Join(lines, "\n"))
	return nil
}

func fleetMCP(t *testing.T, addr string) *mcp.ClientSession {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "fleet", Version: "0"}, nil).Connect(ctx, &mcp.StreamableClientTransport{Endpoint: "http://" + addr + "/mcp"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cs.Close() })
	return cs
}

// lineWatch is a REST watch read in the background.
type lineWatch struct {
	lines chan string
}

func watchLines(t *testing.T, url string) *lineWatch {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	w := &lineWatch{lines: make(chan string, 1024)}
	go func() {
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			select {
			case w.lines <- sc.Text():
			default: // nobody reads that far
			}
		}
		close(w.lines)
	}()
	return w
}

// waitFor reads lines until one holds every part (case-insensitively).
func (w *lineWatch) waitFor(t *testing.T, parts ...string) {
	t.Helper()
	timeout := time.After(30 * time.Second)
	for {
		select {
		case l, ok := <-w.lines:
			if !ok {
				t.Fatalf("watch ended before a line with %q", parts)
			}
			all := true
			for _, p := range parts {
				all = all && strings.Contains(strings.ToLower(l), strings.ToLower(p))
			}
			if all {
				return
			}
		case <-timeout:
			t.Fatalf("no watch line with %q within 30s", parts)
		}
	}
}
