package tests

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/pkg/identity/oidctest"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"github.com/google/jsonschema-go/jsonschema"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// mcpTools are the contract's 20 tools (§2.3) in registration order, then
// our additions (update_vm_lifetime, suspend_vm, resume_vm, import_image,
// the pool tools, fork_vm), with their annotation class; tools/list sorts them by
// name, as the original's mcp-go did.
var mcpTools = []struct{ name, class string }{
	{"get_info", "read"}, {"get_host", "read"}, {"list_images", "read"}, {"get_image", "read"},
	{"list_networks", "read"}, {"get_network", "read"}, {"list_vms", "read"}, {"get_vm", "read"},
	{"get_vm_console", "read"}, {"get_vm_metrics", "read"}, {"get_vm_attestation", "read"},
	{"create_network", "create"}, {"delete_network", "destructive"}, {"create_vm", "create"},
	{"start_vm", "idempotent"}, {"stop_vm", "idempotent"}, {"reboot_vm", "idempotent"},
	{"delete_vm", "destructive"}, {"exec_vm", "exec"}, {"forward_port", "idempotent"},
	{"update_vm_lifetime", "lifetime"},
	{"suspend_vm", "idempotent"}, {"resume_vm", "idempotent"}, // issue 19
	{"import_image", "import"}, // issue 27
	// Warm pools.
	{"list_pools", "read"}, {"get_pool", "read"}, {"create_pool", "create"},
	{"resize_pool", "idempotent"}, {"delete_pool", "destructive"},
	{"fork_vm", "create"}, // forks
}

// classOf reads an annotation class back from the hints (contract §2.2).
func classOf(a *mcp.ToolAnnotations) string {
	if a == nil {
		return "none"
	}
	destructive := a.DestructiveHint != nil && *a.DestructiveHint
	open := a.OpenWorldHint != nil && *a.OpenWorldHint
	switch {
	case a.ReadOnlyHint && !destructive && a.IdempotentHint && !open:
		return "read"
	case !a.ReadOnlyHint && destructive && a.IdempotentHint && !open:
		return "destructive"
	case !a.ReadOnlyHint && destructive && !a.IdempotentHint && open:
		return "exec"
	case !a.ReadOnlyHint && !destructive && a.IdempotentHint && !open:
		return "idempotent"
	case !a.ReadOnlyHint && !destructive && !a.IdempotentHint && !open:
		return "create"
	case !a.ReadOnlyHint && destructive && !a.IdempotentHint && !open:
		return "lifetime"
	case !a.ReadOnlyHint && !destructive && a.IdempotentHint && open:
		return "import"
	}
	return fmt.Sprintf("%+v", *a)
}

// bearerTransport adds a token to every request of the MCP client.
type bearerTransport struct{ token string }

func (b bearerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return http.DefaultTransport.RoundTrip(r)
}

// mcpSession connects the go-sdk client to the gateway's /mcp.
func mcpSession(t *testing.T, addr, token string, onProgress func(*mcp.ProgressNotificationParams)) *mcp.ClientSession {
	t.Helper()
	client := mcp.NewClient(&mcp.Implementation{Name: "vm-manager-tests", Version: "v0"}, &mcp.ClientOptions{
		ProgressNotificationHandler: func(_ context.Context, req *mcp.ProgressNotificationClientRequest) {
			if onProgress != nil {
				onProgress(req.Params)
			}
		},
	})
	cs, err := client.Connect(context.Background(), &mcp.StreamableClientTransport{
		Endpoint:   "http://" + addr + "/mcp",
		HTTPClient: &http.Client{Transport: bearerTransport{token}},
	}, nil)
	if err != nil {
		t.Fatalf("connect to /mcp: %v", err)
	}
	t.Cleanup(func() { cs.Close() })
	return cs
}

// callTool calls a tool and returns its text; a tool error fails the test
// unless wantError.
func callTool(t *testing.T, cs *mcp.ClientSession, name string, args map[string]any, wantError bool) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	params := &mcp.CallToolParams{Name: name, Arguments: args}
	params.SetProgressToken(name + "-progress") // create_vm reports its wait
	res, err := cs.CallTool(ctx, params)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	text := ""
	if len(res.Content) > 0 {
		if tc, ok := res.Content[0].(*mcp.TextContent); ok {
			text = tc.Text
		}
	}
	if res.IsError != wantError {
		t.Fatalf("%s: isError %v, want %v: %s", name, res.IsError, wantError, text)
	}
	if !res.IsError {
		checkStructured(t, cs, name, text, res.StructuredContent)
	}
	return text
}

// mcpOutputs caches each session's tool output schemas for checkStructured.
var mcpOutputs sync.Map // *mcp.ClientSession → map[string]*jsonschema.Resolved

// checkStructured: a result's structuredContent is its text's JSON (a list
// under the list's name) and validates against the tool's outputSchema.
func checkStructured(t *testing.T, cs *mcp.ClientSession, name, text string, structured any) {
	t.Helper()
	v, ok := mcpOutputs.Load(cs)
	if !ok {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		res, err := cs.ListTools(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		schemas := map[string]*jsonschema.Resolved{}
		for _, tool := range res.Tools {
			b, _ := json.Marshal(tool.OutputSchema)
			var s jsonschema.Schema
			if err := json.Unmarshal(b, &s); err != nil {
				t.Fatalf("%s: outputSchema: %v", tool.Name, err)
			}
			if schemas[tool.Name], err = s.Resolve(nil); err != nil {
				t.Fatalf("%s: outputSchema: %v", tool.Name, err)
			}
		}
		v, _ = mcpOutputs.LoadOrStore(cs, schemas)
	}
	schema := v.(map[string]*jsonschema.Resolved)[name]
	if schema == nil {
		t.Fatalf("%s: no outputSchema", name)
	}
	var want any
	if err := json.Unmarshal([]byte(text), &want); err != nil {
		t.Fatalf("%s: text is not JSON: %v", name, err)
	}
	if l, ok := want.([]any); ok {
		want = map[string]any{strings.TrimPrefix(name, "list_"): l}
	}
	if !reflect.DeepEqual(structured, want) {
		t.Errorf("%s: structuredContent is not the text's JSON:\n%v\n%s", name, structured, text)
	}
	if err := schema.Validate(structured); err != nil {
		t.Errorf("%s: structuredContent does not validate against the outputSchema: %v\n%s", name, err, text)
	}
}

// TestMCPEndToEnd drives a VM from get_host to delete_vm with the MCP SDK's
// own client through the gateway, with identity on: the caller's token
// reaches the hypervisor, which records the caller on the VM; create_vm
// reports progress while the guest boots; /metrics counts every surface.
func TestMCPEndToEnd(t *testing.T) {
	images := cluster.GuestImages(t, "..")
	op := oidctest.Start(t)
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, OIDCIssuer: op.Issuer(), OIDCAudiences: []string{op.Audience}})
	token := op.Token(oidctest.Claims{Subject: "agent-7", Email: "agent@example.com"})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() {
		// killVMs reads the list with a token-less client: kill by name here.
		code, _, b := authDo(t, "GET", a.base+"/vms", "Bearer "+token, "")
		var list []vmJSON
		if code == 200 && json.Unmarshal(b, &list) == nil {
			for _, v := range list {
				authDo(t, "DELETE", a.base+"/vms/"+v.ID, "Bearer "+token, "")
			}
		}
	})

	// Without a token /mcp is a plain HTTP 401.
	if code, hdr, _ := authDo(t, "POST", "http://"+c.Addr+"/mcp", "", `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}`); code != http.StatusUnauthorized || !strings.HasPrefix(hdr.Get("WWW-Authenticate"), "Bearer") {
		t.Fatalf("/mcp without a token: %d %v", code, hdr)
	}

	var (
		mu       sync.Mutex
		progress []string
	)
	cs := mcpSession(t, c.Addr, token, func(p *mcp.ProgressNotificationParams) {
		mu.Lock()
		defer mu.Unlock()
		progress = append(progress, p.Message)
	})
	if init := cs.InitializeResult(); init.ServerInfo.Name != "vm-manager" || !strings.Contains(init.Instructions, "get_host") {
		t.Errorf("server info %+v, instructions %q", init.ServerInfo, init.Instructions)
	}

	t.Run("tools", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		res, err := cs.ListTools(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Tools) != len(mcpTools) {
			t.Fatalf("%d tools, want %d", len(res.Tools), len(mcpTools))
		}
		sorted := slices.SortedFunc(slices.Values(mcpTools), func(a, b struct{ name, class string }) int { return strings.Compare(a.name, b.name) })
		name := regexp.MustCompile(`^[a-z_]+$`)
		for i, tool := range res.Tools {
			want := sorted[i]
			if s, _ := tool.OutputSchema.(map[string]any); s["type"] != "object" {
				t.Errorf("%s: outputSchema %v", tool.Name, tool.OutputSchema)
			}
			if tool.Name != want.name || classOf(tool.Annotations) != want.class || !name.MatchString(tool.Name) {
				t.Errorf("tool %d: %s (%s), want %s (%s)", i, tool.Name, classOf(tool.Annotations), want.name, want.class)
			}
			prefix := "Read-only."
			switch want.class {
			case "create", "idempotent", "import":
				prefix = "WRITES:"
			case "destructive", "exec", "lifetime":
				prefix = "WRITES (destructive):"
			}
			if !strings.HasPrefix(tool.Description, prefix) {
				t.Errorf("%s: description %q does not start with %q", tool.Name, tool.Description, prefix)
			}
		}
	})

	var vm struct {
		ID, State, IP, CreatedBy string
	}
	t.Run("get_host to delete_vm", func(t *testing.T) {
		if !strings.Contains(callTool(t, cs, "get_host", nil, false), `"qemu"`) {
			t.Error("get_host has no qemu")
		}
		if !strings.Contains(callTool(t, cs, "list_images", nil, false), "test-guest") {
			t.Error("list_images lacks the test guest")
		}
		if !strings.Contains(callTool(t, cs, "get_network", map[string]any{"name": "default"}, false), "192.168.127.0/24") {
			t.Error("get_network default")
		}
		ign := `{"ignition":{"version":"3.4.0"},"storage":{"files":[{"path":"/etc/agent","contents":{"source":"data:,from-mcp"}}]}}`
		out := callTool(t, cs, "create_vm", map[string]any{"name": "mcp1", "image": "test-guest", "cpus": 1, "memory_mib": 384,
			"require_attestation": false, "user_data": ign, "wait_for": "ready"}, false)
		if err := json.Unmarshal([]byte(out), &vm); err != nil || vm.State != "ready" || vm.CreatedBy != "agent@example.com" {
			t.Fatalf("create_vm: %v %s", err, out)
		}
		// The client handles notifications on its own goroutine: the last one
		// may land just after the result.
		var seen string
		deadline := time.Now().Add(5 * time.Second)
		for {
			mu.Lock()
			seen = strings.Join(progress, "|")
			mu.Unlock()
			if strings.Contains(seen, " is ready") || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		// From the watch, every state of the create (the result alone
		// would only say ready).
		if !strings.HasPrefix(seen, "vm "+vm.ID+" is creating|") || !strings.Contains(seen, " is booting|") || !strings.Contains(seen, " is ready") {
			t.Errorf("progress notifications: %q", seen)
		}
		if got := callTool(t, cs, "get_vm", map[string]any{"id": vm.ID}, false); !strings.Contains(got, `"state": "ready"`) {
			t.Errorf("get_vm: %s", got)
		}
		var ex execJSON
		if err := json.Unmarshal([]byte(callTool(t, cs, "exec_vm", map[string]any{"id": vm.ID, "command": []string{"cat", "/etc/agent"}}, false)), &ex); err != nil || ex.Stdout != "from-mcp" {
			t.Errorf("exec_vm: %+v %v", ex, err)
		}
		var fwd struct{ Address string }
		if err := json.Unmarshal([]byte(callTool(t, cs, "forward_port", map[string]any{"id": vm.ID, "port": 22}, false)), &fwd); err != nil {
			t.Fatal(err)
		}
		if line, err := sshBanner(fwd.Address); err != nil || !strings.HasPrefix(line, "SSH-2.0-") {
			t.Errorf("forward_port 22 answered %q %v", line, err)
		}
		if got := callTool(t, cs, "get_vm_console", map[string]any{"id": vm.ID, "lines": 50}, false); !strings.Contains(got, "vm-agent") {
			t.Errorf("get_vm_console: %.200s", got)
		}
		if got := callTool(t, cs, "get_vm_console", map[string]any{"id": vm.ID, "lines": 0}, false); !strings.Contains(got, `"lines": 100`) {
			t.Errorf("get_vm_console lines 0 (the default, as REST's ?lines=0): %.200s", got)
		}
		if got := callTool(t, cs, "get_vm_attestation", map[string]any{"id": vm.ID}, false); !strings.Contains(got, `"userDataReleased": true`) {
			t.Errorf("get_vm_attestation: %s", got)
		}
		if got := callTool(t, cs, "get_vm_metrics", map[string]any{"id": vm.ID}, false); !strings.Contains(got, `"boot_to_ready_seconds"`) {
			t.Errorf("get_vm_metrics: %s", got)
		}
		if got := callTool(t, cs, "get_vm", map[string]any{"id": "ffffffff"}, true); !strings.HasPrefix(got, "not_found: ") {
			t.Errorf("unknown vm: %s", got)
		}
		if got := callTool(t, cs, "exec_vm", map[string]any{"id": vm.ID}, true); !strings.HasPrefix(got, "invalid_request: ") {
			t.Errorf("exec_vm without command: %s", got)
		}
		// The guest's systemd-report (vm-agent uploads one at ready, then
		// every 15 s) becomes vm_guest_* families, typed by its describe list.
		var scrape string
		cluster.Eventually(t, 40*time.Second, "the guest's report in /metrics", func() error {
			scrape = scrapeMetrics(t, c.Addr)
			if !strings.Contains(scrape, `vm_guest_reports_total{vm="`+vm.ID+`"}`) || strings.Contains(scrape, `vm_guest_reports_total{vm="`+vm.ID+`"} 0`) {
				return fmt.Errorf("no report counted yet")
			}
			return nil
		})
		for _, want := range []string{
			`vm_manager_vm_state{name="mcp1",state="ready",vm="` + vm.ID + `"} 1`,
			`vm_manager_requests_total{code="ok",method="get_host",surface="mcp"} 1`,
			`vm_manager_network_leases{network="default"} 1`,
			"# TYPE vm_guest_io_vmagent_context_switches_total counter",
			`vm_guest_io_vmagent_context_switches_total{object="",vm="` + vm.ID + `"} `,
			"# TYPE vm_guest_io_vmagent_uptime_seconds gauge",
			`vm_guest_io_vmagent_load_average{object="",period="1m",vm="` + vm.ID + `"} `,
			// Not required and no golden values: the guest saw its quote rejected.
			`vm_guest_io_vmagent_attestation_info{object="initrd",value="rejected",vm="` + vm.ID + `"} 1`,
			`vm_guest_report_series_dropped_total{reason="unsupported",vm="` + vm.ID + `"} 0`,
		} {
			if !strings.Contains(scrape, want) {
				t.Errorf("/metrics lacks %s", want)
			}
		}
		if t.Failed() {
			for _, line := range strings.Split(scrape, "\n") {
				if strings.HasPrefix(line, "vm_guest_") {
					t.Log(line)
				}
			}
		}
		t.Run("JSON-only client", func(t *testing.T) { mcpJSONOnly(t, c.Addr, token, vm.ID) })
		if got := callTool(t, cs, "delete_vm", map[string]any{"id": vm.ID}, false); !strings.Contains(got, `"deleted": true`) {
			t.Errorf("delete_vm: %s", got)
		}
		if got := callTool(t, cs, "list_vms", nil, false); strings.Contains(got, vm.ID) {
			t.Errorf("list_vms after delete: %s", got)
		}
	})
}

// mcpJSONOnly drives /mcp as curl does, accepting only JSON: every answer
// is one plain JSON-RPC body, and arguments are taken as the original took
// them (a port as a string, an undeclared argument ignored).
func mcpJSONOnly(t *testing.T, addr, token, id string) {
	session := ""
	post := func(body string) (int, http.Header, []byte) {
		t.Helper()
		h := http.Header{"Authorization": {"Bearer " + token}, "Accept": {"application/json"}}
		if session != "" {
			h.Set("Mcp-Session-Id", session)
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		return cluster.DoContext(ctx, t, "POST", "http://"+addr+"/mcp", body, h)
	}
	type reply struct {
		Result struct {
			Tools []struct {
				Name string `json:"name"`
			} `json:"tools"`
			Content []struct {
				Text string `json:"text"`
			} `json:"content"`
			StructuredContent map[string]any `json:"structuredContent"`
			IsError           bool           `json:"isError"`
		} `json:"result"`
	}
	rpc := func(body string) reply {
		t.Helper()
		code, hdr, b := post(body)
		var r reply
		if code != http.StatusOK || !strings.HasPrefix(hdr.Get("Content-Type"), "application/json") || json.Unmarshal(b, &r) != nil {
			t.Fatalf("%s: %d %q %s", body, code, hdr.Get("Content-Type"), b)
		}
		return r
	}
	code, hdr, b := post(`{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"curl","version":"8"}}}`)
	if session = hdr.Get("Mcp-Session-Id"); code != http.StatusOK || session == "" || !strings.HasPrefix(hdr.Get("Content-Type"), "application/json") {
		t.Fatalf("initialize: %d %v %s", code, hdr, b)
	}
	if code, _, b := post(`{"jsonrpc":"2.0","method":"notifications/initialized"}`); code != http.StatusAccepted {
		t.Fatalf("notifications/initialized: %d %s", code, b)
	}
	var names []string
	for _, tool := range rpc(`{"jsonrpc":"2.0","id":2,"method":"tools/list"}`).Result.Tools {
		names = append(names, tool.Name)
	}
	if len(names) != len(mcpTools) || !slices.IsSorted(names) {
		t.Errorf("tools/list: %v", names)
	}
	fwd := rpc(`{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"forward_port","arguments":{"id":"` + id + `","port":"22","protocol":"tcp"}}}`)
	addrFwd, _ := fwd.Result.StructuredContent["address"].(string)
	if fwd.Result.IsError || fwd.Result.StructuredContent["port"] != float64(22) || addrFwd == "" {
		t.Fatalf("forward_port: %+v", fwd.Result)
	}
	if line, err := sshBanner(addrFwd); err != nil || !strings.HasPrefix(line, "SSH-2.0-") {
		t.Errorf("forward_port 22 answered %q %v", line, err)
	}
	if got := rpc(`{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"get_vm","arguments":{"id":"` + id + `"}}}`); got.Result.IsError || got.Result.StructuredContent["state"] != "ready" {
		t.Errorf("get_vm: %+v", got.Result)
	}
}

// scrapeMetrics reads /metrics (an open path).
func scrapeMetrics(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b strings.Builder
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		b.WriteString(sc.Text())
		b.WriteByte('\n')
	}
	if resp.StatusCode != 200 {
		t.Fatalf("/metrics: %d", resp.StatusCode)
	}
	return b.String()
}

// seriesValue is the value of one series in a /metrics text, or -1.
func seriesValue(text, series string) float64 {
	for line := range strings.SplitSeq(text, "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			if err == nil {
				return f
			}
		}
	}
	return -1
}
