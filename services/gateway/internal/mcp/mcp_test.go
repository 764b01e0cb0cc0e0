package mcp

import (
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/gen/apierr"
	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/buildinfo"
	"github.com/giantswarm/vm-manager/pkg/logging/logtest"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/giantswarm/vm-manager/services/gateway/internal/restjson"
	"github.com/google/jsonschema-go/jsonschema"
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
	f.vm.State = s
}

// CreateVirtualMachine takes ~2.5 s: creating, then booting at 0.6 s, ready
// at 1.5 s, and returns at 2.5 s.
func (f *fakeHypervisor) CreateVirtualMachine(ctx context.Context, req *hypervisorv1.CreateVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	f.record(ctx)
	f.mu.Lock()
	f.createReq = proto.CloneOf(req)
	f.vm = &hypervisorv1.VirtualMachine{Id: "0a1b2c3d", Name: req.GetName(), State: hypervisorv1.State_STATE_CREATING, CreatedAt: timestamppb.Now()}
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
	session *mcp.ClientSession

	mu       sync.Mutex
	progress []*mcp.ProgressNotificationParams
	observed []string // tool calls the Observer saw: "<tool> <code>"
}

func (h *harness) progressSeen() []*mcp.ProgressNotificationParams {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.progress)
}

// authTransport sets the Authorization header on every MCP HTTP request.
type authTransport struct{ token string }

func (a authTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", a.token)
	return http.DefaultTransport.RoundTrip(r)
}

const testToken = "Bearer test-token-123"

func newHarness(t *testing.T) *harness {
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
	gs := grpc.NewServer()
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

	h := &harness{hv: hv}
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

// ---- tests ----

func TestServerInfo(t *testing.T) {
	h := newHarness(t)
	init := h.session.InitializeResult()
	if init.ServerInfo.Name != "vm-manager" || init.ServerInfo.Version != buildinfo.Version {
		t.Errorf("server info = %+v", init.ServerInfo)
	}
	if !strings.Contains(init.Instructions, "Call get_host first") && !strings.Contains(init.Instructions, "call get_host first") {
		t.Errorf("instructions do not say to call get_host first:\n%s", init.Instructions)
	}
	for _, want := range []string{"running", "a timeout error still leaves the VM running", "require_attestation is false", "get_vm_console", "exec_vm", "6443", "delete_network"} {
		if !strings.Contains(strings.ToLower(init.Instructions), strings.ToLower(want)) {
			t.Errorf("instructions do not mention %q", want)
		}
	}
	if init.Capabilities.Tools == nil || init.Capabilities.Tools.ListChanged {
		t.Errorf("tools capability = %+v, want tools without listChanged", init.Capabilities.Tools)
	}
}

func TestListTools(t *testing.T) {
	h := newHarness(t)
	res, err := h.session.ListTools(context.Background(), nil)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, tool := range res.Tools {
		names = append(names, tool.Name)
	}
	if !slices.Equal(names, ToolNames) {
		t.Fatalf("tools = %v\nwant   %v", names, ToolNames)
	}
	if len(ToolNames) != 20 {
		t.Errorf("%d tools, want 20", len(ToolNames))
	}

	type hints struct{ readOnly, destructive, idempotent, openWorld bool }
	classes := map[string]hints{
		"read":        {true, false, true, false},
		"create":      {false, false, false, false},
		"idempotent":  {false, false, true, false},
		"destructive": {false, true, true, false},
		"exec":        {false, true, false, true},
	}
	classOf := map[string]string{
		"create_network": "create", "create_vm": "create",
		"delete_network": "destructive", "delete_vm": "destructive",
		"start_vm": "idempotent", "stop_vm": "idempotent", "reboot_vm": "idempotent", "forward_port": "idempotent",
		"exec_vm": "exec",
	}
	required := map[string][]string{
		"get_image":          {"ref"},
		"get_network":        {"name"},
		"get_vm":             {"id"},
		"get_vm_console":     {"id"},
		"get_vm_metrics":     {"id"},
		"get_vm_attestation": {"id"},
		"create_network":     {"name", "cidr"},
		"delete_network":     {"name"},
		"create_vm":          {"name"},
		"start_vm":           {"id"},
		"stop_vm":            {"id"},
		"reboot_vm":          {"id"},
		"delete_vm":          {"id"},
		"exec_vm":            {"id", "command"},
		"forward_port":       {"id", "port"},
	}
	nameRE := regexp.MustCompile(`^[a-z_]+$`)
	for _, tool := range res.Tools {
		if !nameRE.MatchString(tool.Name) {
			t.Errorf("%s: name does not match %s", tool.Name, nameRE)
		}
		class := classOf[tool.Name]
		if class == "" {
			class = "read"
		}
		a := tool.Annotations
		if a == nil || a.DestructiveHint == nil || a.OpenWorldHint == nil {
			t.Errorf("%s: annotations incomplete: %+v", tool.Name, a)
			continue
		}
		got := hints{a.ReadOnlyHint, *a.DestructiveHint, a.IdempotentHint, *a.OpenWorldHint}
		if got != classes[class] {
			t.Errorf("%s: hints %+v, want class %s %+v", tool.Name, got, class, classes[class])
		}
		var prefix string
		switch {
		case got.readOnly:
			prefix = "Read-only. "
		case got.destructive:
			prefix = "WRITES (destructive): "
		default:
			prefix = "WRITES: "
		}
		if !strings.HasPrefix(tool.Description, prefix) {
			t.Errorf("%s: description %q does not start with %q", tool.Name, tool.Description, prefix)
		}

		b, _ := json.Marshal(tool.InputSchema)
		var schema jsonschema.Schema
		if err := json.Unmarshal(b, &schema); err != nil {
			t.Fatalf("%s: schema: %v", tool.Name, err)
		}
		if schema.Type != "object" {
			t.Errorf("%s: schema type %q", tool.Name, schema.Type)
		}
		req := slices.Clone(schema.Required)
		slices.Sort(req)
		want := slices.Clone(required[tool.Name])
		slices.Sort(want)
		if !slices.Equal(req, want) {
			t.Errorf("%s: required %v, want %v", tool.Name, req, want)
		}
		for name, p := range schema.Properties {
			if p.Description == "" {
				t.Errorf("%s.%s: no description", tool.Name, name)
			}
		}
		switch tool.Name {
		case "create_vm":
			wf := schema.Properties["wait_for"]
			if !slices.Equal(wf.Enum, []any{"none", "installed", "attested", "ready"}) {
				t.Errorf("create_vm.wait_for enum = %v", wf.Enum)
			}
			for _, c := range []struct {
				prop     string
				min, max float64
			}{{"cpus", 1, 256}, {"memory_mib", 256, 0}, {"disk_gib", 1, 4096}} {
				p := schema.Properties[c.prop]
				if p.Type != "integer" || p.Minimum == nil || *p.Minimum != c.min || (c.max != 0 && (p.Maximum == nil || *p.Maximum != c.max)) {
					t.Errorf("create_vm.%s: %s", c.prop, mustJSON(p))
				}
			}
			if p := schema.Properties["ssh_authorized_keys"]; p.Type != "array" || p.Items.Type != "string" {
				t.Errorf("create_vm.ssh_authorized_keys: %s", mustJSON(p))
			}
			if p := schema.Properties["metadata"]; p.Type != "object" || p.AdditionalProperties == nil || p.AdditionalProperties.Type != "string" {
				t.Errorf("create_vm.metadata: %s", mustJSON(p))
			}
			if p := schema.Properties["require_attestation"]; p.Type != "boolean" {
				t.Errorf("create_vm.require_attestation: %s", mustJSON(p))
			}
		case "get_vm_console":
			p := schema.Properties["lines"]
			if p.Minimum == nil || *p.Minimum != 0 || p.Maximum == nil || *p.Maximum != 10000 || string(p.Default) != "100" {
				t.Errorf("get_vm_console.lines: %s", mustJSON(p))
			}
		case "forward_port":
			p := schema.Properties["port"]
			if p.Minimum == nil || *p.Minimum != 1 || p.Maximum == nil || *p.Maximum != 65535 {
				t.Errorf("forward_port.port: %s", mustJSON(p))
			}
		case "exec_vm":
			p := schema.Properties["command"]
			if p.Type != "array" || p.MinItems == nil || *p.MinItems != 1 {
				t.Errorf("exec_vm.command: %s", mustJSON(p))
			}
		}
	}
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func TestGetHostIsTheRESTBody(t *testing.T) {
	h := newHarness(t)
	got := wantOK(t, h.call(t, "get_host", nil))
	want, err := restjson.Marshaler{}.Marshal(h.hv.host)
	if err != nil {
		t.Fatal(err)
	}
	if got != string(want) {
		t.Errorf("get_host =\n%s\nwant\n%s", got, want)
	}
	if !strings.Contains(got, "\n  \"hostname\": \"node1\"") {
		t.Errorf("not 2-space-indented: %s", got)
	}
}

func TestListIsAnArray(t *testing.T) {
	h := newHarness(t)
	if got := wantOK(t, h.call(t, "list_images", map[string]any{})); got != "[]\n" {
		t.Errorf("list_images = %q, want []", got)
	}
}

func TestGetInfo(t *testing.T) {
	h := newHarness(t)
	var info Info
	if err := json.Unmarshal([]byte(wantOK(t, h.call(t, "get_info", nil))), &info); err != nil {
		t.Fatal(err)
	}
	if info.Version != buildinfo.Version || info.Commit == "" || info.Built == "" || !slices.Equal(info.Tools, ToolNames) {
		t.Errorf("get_info = %+v", info)
	}
}

func TestBackendError(t *testing.T) {
	h := newHarness(t)
	wantError(t, h.call(t, "get_vm", map[string]any{"id": "deadbeef"}), `not_found: vm "deadbeef" not found`)
	wantError(t, h.call(t, "get_vm_attestation", map[string]any{"id": "deadbeef"}), `not_found: vm "deadbeef" not found`)
	// The fake does not implement GetNetwork: Unimplemented is "unsupported".
	wantError(t, h.call(t, "get_network", map[string]any{"name": "default"}), "unsupported: ")
	wantError(t, h.call(t, "get_vm", map[string]any{}), "invalid_request: ")
	h.call(t, "get_host", nil)
	h.mu.Lock()
	defer h.mu.Unlock()
	want := []string{"get_vm not_found", "get_vm_attestation not_found", "get_network unsupported", "get_vm invalid_request", "get_host ok"}
	if strings.Join(h.observed, ",") != strings.Join(want, ",") {
		t.Errorf("observed %q, want %q", h.observed, want)
	}
}

func TestArgumentErrors(t *testing.T) {
	h := newHarness(t)
	for _, c := range []struct {
		tool string
		args any
		want string
	}{
		{"get_vm", nil, `missing required argument "id"`},
		{"get_vm", map[string]any{}, `missing required argument "id"`},
		{"exec_vm", map[string]any{"id": "0a1b2c3d"}, `missing required argument "command"`},
		{"exec_vm", map[string]any{"id": "0a1b2c3d", "command": []string{}}, `argument "command": must not be empty`},
		{"exec_vm", map[string]any{"id": "0a1b2c3d", "command": []any{"ls", 1}}, `argument "command": item 1: want a string`},
		{"create_network", map[string]any{}, `missing required arguments "name", "cidr"`},
		{"get_vm", map[string]any{"id": 7}, `argument "id": want a string, got an integer`},
		{"get_vm", map[string]any{"id": "0a1b2c3d", "bogus": 1}, `unknown argument "bogus"`},
		{"get_host", map[string]any{"bogus": 1}, `unknown argument "bogus": this tool takes no arguments`},
		{"get_vm_console", map[string]any{"id": "0a1b2c3d", "lines": 20000}, `argument "lines": 20000 is more than the maximum 10000`},
		{"get_vm_console", map[string]any{"id": "0a1b2c3d", "lines": "ten"}, `argument "lines": want an integer, got a string`},
		{"forward_port", map[string]any{"id": "0a1b2c3d", "port": 0}, `argument "port": 0 is less than the minimum 1`},
		{"forward_port", map[string]any{"id": "0a1b2c3d", "port": 1.5}, `argument "port": want an integer, got a number`},
		{"create_vm", map[string]any{"name": "a", "wait_for": "forever"}, `argument "wait_for": "forever" is not one of none, installed, attested, ready`},
		{"create_vm", map[string]any{"name": "a", "cpus": nil}, `argument "cpus": want an integer, got null`},
		{"create_vm", map[string]any{"name": "a", "memory_mib": 128}, `argument "memory_mib": 128 is less than the minimum 256`},
		{"create_vm", map[string]any{"name": "a", "require_attestation": "yes"}, `argument "require_attestation": want true or false`},
		{"create_vm", map[string]any{"name": "a", "metadata": map[string]any{"k": 1}}, `argument "metadata": key "k": want a string`},
		{"create_vm", map[string]any{"wait_for": "none"}, `missing required argument "name"`},
	} {
		s := wantError(t, h.call(t, c.tool, c.args), "invalid_request: ")
		if s != "invalid_request: "+c.want && !strings.HasPrefix(s, "invalid_request: "+c.want) {
			t.Errorf("%s %v: %q does not mention %q", c.tool, c.args, s, c.want)
		}
	}
	if h.hv.lastCreate() != nil || h.hv.lastExec() != nil {
		t.Error("a rejected call reached the backend")
	}
}

func TestUnknownToolIsProtocolError(t *testing.T) {
	h := newHarness(t)
	_, err := h.session.CallTool(context.Background(), &mcp.CallToolParams{Name: "no_such_tool"})
	if err == nil || !strings.Contains(err.Error(), "no_such_tool") {
		t.Fatalf("err = %v, want a protocol error naming the tool", err)
	}
}

func TestAuthorizationForwarded(t *testing.T) {
	h := newHarness(t)
	wantOK(t, h.call(t, "get_host", nil))
	if got := h.hv.authSeen(); !slices.Equal(got, []string{testToken}) {
		t.Errorf("backend saw authorization %q, want [%q]", got, testToken)
	}
}

func TestArgumentsReachTheBackend(t *testing.T) {
	h := newHarness(t)
	got := wantOK(t, h.call(t, "exec_vm", map[string]any{"id": "0a1b2c3d", "command": []string{"uname", "-r"}}))
	if want := "{\n  \"stdout\": \"uname -r\\n\",\n  \"exitCode\": 3,\n  \"truncated\": false\n}\n"; got != want {
		t.Errorf("exec_vm =\n%s\nwant\n%s", got, want)
	}
	got = wantOK(t, h.call(t, "get_vm_console", map[string]any{"id": "0a1b2c3d"}))
	if !strings.Contains(got, `"lines": 100`) {
		t.Errorf("get_vm_console without lines: %s, want the default 100", got)
	}
	// 0 is accepted, as REST's ?lines=0 is (contract §1.2): it reaches the
	// hypervisor, which reads it as the default (this fake echoes it).
	got = wantOK(t, h.call(t, "get_vm_console", map[string]any{"id": "0a1b2c3d", "lines": 0}))
	if !strings.Contains(got, `"lines": 0`) {
		t.Errorf("get_vm_console lines 0: %s", got)
	}
	got = wantOK(t, h.call(t, "delete_vm", map[string]any{"id": "0a1b2c3d"}))
	if want := "{\n  \"id\": \"0a1b2c3d\",\n  \"deleted\": true\n}\n"; got != want {
		t.Errorf("delete_vm = %s, want %s", got, want)
	}

	wantOK(t, h.call(t, "create_vm", map[string]any{
		"name": "quick", "cpus": 4, "ssh_authorized_keys": []string{"ssh-ed25519 AAAA k"},
		"metadata": map[string]string{"role": "worker"}, "require_attestation": false, "wait_for": "installed",
	}))
	r := h.hv.lastCreate()
	if r.GetName() != "quick" || r.GetCpus() != 4 || r.GetMemoryMib() != 2048 || r.GetDiskGib() != 20 ||
		r.RequireAttestation == nil || *r.RequireAttestation || r.GetWaitFor() != hypervisorv1.WaitFor_WAIT_FOR_INSTALLED ||
		!slices.Equal(r.GetSshAuthorizedKeys(), []string{"ssh-ed25519 AAAA k"}) || r.GetMetadata()["role"] != "worker" {
		t.Errorf("CreateVirtualMachine got %v", r)
	}
	wantOK(t, h.call(t, "create_vm", map[string]any{"name": "quick"}))
	r = h.hv.lastCreate()
	if r.GetWaitFor() != hypervisorv1.WaitFor_WAIT_FOR_READY || !r.GetRequireAttestation() {
		t.Errorf("CreateVirtualMachine defaults: %v", r)
	}
}

func TestCreateVMProgress(t *testing.T) {
	h := newHarness(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	params := &mcp.CallToolParams{Name: "create_vm", Arguments: map[string]any{"name": "worker-1"}}
	params.SetProgressToken("tok-1")
	res, err := h.session.CallTool(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	got := wantOK(t, res)
	if !strings.Contains(got, `"state": "ready"`) {
		t.Errorf("create_vm = %s", got)
	}
	// Notifications travel on the same stream ahead of the result, but the
	// client dispatches them asynchronously.
	deadline := time.Now().Add(2 * time.Second)
	for len(h.progressSeen()) < 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	ps := h.progressSeen()
	if len(ps) < 2 {
		t.Fatalf("got %d progress notifications, want at least 2: %v", len(ps), ps)
	}
	var msgs []string
	for i, p := range ps {
		msgs = append(msgs, p.Message)
		if p.ProgressToken != "tok-1" {
			t.Errorf("notification %d token = %v", i, p.ProgressToken)
		}
		if p.Progress != float64(i+1) {
			t.Errorf("notification %d progress = %v, want %d", i, p.Progress, i+1)
		}
		if !regexp.MustCompile(`^vm 0a1b2c3d is [a-z]+$`).MatchString(p.Message) {
			t.Errorf("notification %d message = %q", i, p.Message)
		}
	}
	if msgs[len(msgs)-1] != "vm 0a1b2c3d is ready" {
		t.Errorf("last progress message = %q", msgs[len(msgs)-1])
	}
	if !slices.Contains(msgs, "vm 0a1b2c3d is booting") {
		t.Errorf("progress messages %q miss booting", msgs)
	}
	for i := 1; i < len(msgs); i++ {
		if msgs[i] == msgs[i-1] {
			t.Errorf("progress repeated %q", msgs[i])
		}
	}
}

func TestCreateVMWithoutProgressToken(t *testing.T) {
	h := newHarness(t)
	wantOK(t, h.call(t, "create_vm", map[string]any{"name": "quick"}))
	if ps := h.progressSeen(); len(ps) != 0 {
		t.Errorf("progress without a token: %v", ps)
	}
}

// noBackendSession is an MCP client session with a server whose backends'
// sockets do not exist, dialled as the gateway dials them.
func noBackendSession(t *testing.T, log *slog.Logger) *mcp.ClientSession {
	t.Helper()
	dial := func(name string) *grpc.ClientConn {
		conn, err := mesh.DialBackend(t.TempDir()+"/nothing.sock", name)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		return conn
	}
	ts := httptest.NewServer(New(hypervisorv1.NewHypervisorServiceClient(dial("hypervisor")), attestationv1.NewAttestationServiceClient(dial("attestation")), log, nil))
	t.Cleanup(ts.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cs, err := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil).Connect(ctx, &mcp.StreamableClientTransport{Endpoint: ts.URL}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

func TestBackendDown(t *testing.T) {
	cs := noBackendSession(t, nil)
	t.Cleanup(func() { _ = cs.Close() })
	h := &harness{session: cs}
	wantError(t, h.call(t, "get_host", nil), "unavailable: the hypervisor service is unavailable: ")
	wantError(t, h.call(t, "get_vm_attestation", map[string]any{"id": "0a1b2c3d"}), "unavailable: the attestation service is unavailable: ")
	// get_info needs no backend.
	wantOK(t, h.call(t, "get_info", nil))
}

// TestSessionsQuietAtInfo: an MCP client's session (connect, a call, close)
// writes nothing at info; the SDK's lifecycle lines are debug.
func TestSessionsQuietAtInfo(t *testing.T) {
	for _, level := range []slog.Level{slog.LevelInfo, slog.LevelDebug} {
		t.Run(level.String(), func(t *testing.T) {
			var logs logtest.Buffer
			cs := noBackendSession(t, slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: level})))
			wantOK(t, (&harness{session: cs}).call(t, "get_info", nil))
			_ = cs.Close()
			got := ""
			for range 50 { // the server logs the disconnect after the client returns
				if got = logs.String(); strings.Contains(got, "disconnected") {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			switch level {
			case slog.LevelInfo:
				if got != "" {
					t.Errorf("a session at info logged:\n%s", got)
				}
			case slog.LevelDebug:
				for _, want := range []string{"level=DEBUG msg=\"server session connected\"", "level=DEBUG msg=\"session initialized\"", "level=DEBUG msg=\"server session disconnected\""} {
					if !strings.Contains(got, want) {
						t.Errorf("debug log lacks %s:\n%s", want, got)
					}
				}
			}
		})
	}
}
