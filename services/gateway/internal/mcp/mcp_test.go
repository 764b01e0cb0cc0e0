package mcp

import (
	"context"
	"encoding/json"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/buildinfo"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"github.com/giantswarm/vm-manager/services/gateway/internal/restjson"
	"github.com/google/jsonschema-go/jsonschema"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
)

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
	// Sorted by name, as the original's mcp-go listed them.
	if want := slices.Sorted(slices.Values(ToolNames)); !slices.Equal(names, want) {
		t.Fatalf("tools = %v\nwant   %v", names, want)
	}
	if len(ToolNames) != 30 { // the original's 20, update_vm_lifetime, suspend_vm, resume_vm, import_image, the five pool tools and fork_vm
		t.Errorf("%d tools, want 30", len(ToolNames))
	}

	type hints struct{ readOnly, destructive, idempotent, openWorld bool }
	classes := map[string]hints{
		"read":        {true, false, true, false},
		"create":      {false, false, false, false},
		"idempotent":  {false, false, true, false},
		"destructive": {false, true, true, false},
		"exec":        {false, true, false, true},
		"lifetime":    {false, true, false, false},
		"import":      {false, false, true, true},
	}
	classOf := map[string]string{
		"create_network": "create", "create_vm": "create",
		"delete_network": "destructive", "delete_vm": "destructive",
		"start_vm": "idempotent", "stop_vm": "idempotent", "reboot_vm": "idempotent", "forward_port": "idempotent",
		"suspend_vm": "idempotent", "resume_vm": "idempotent",
		"exec_vm": "exec", "update_vm_lifetime": "lifetime", "import_image": "import",
		"create_pool": "create", "resize_pool": "idempotent", "delete_pool": "destructive",
		"fork_vm": "create",
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
		"update_vm_lifetime": {"id"},
		"suspend_vm":         {"id"},
		"resume_vm":          {"id"},
		"import_image":       {"source"},
		"get_pool":           {"name"},
		"create_pool":        {"name", "size"},
		"resize_pool":        {"name", "size"},
		"delete_pool":        {"name"},
		"fork_vm":            {"id"},
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
		if schema.AdditionalProperties != nil {
			t.Errorf("%s: undeclared arguments are ignored, but the schema refuses them", tool.Name)
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
			// "" and 0 are the default, as in the original: the schema takes them.
			wf := schema.Properties["wait_for"]
			if !slices.Equal(wf.Enum, []any{"none", "installed", "attested", "ready", ""}) || string(wf.Default) != `"ready"` {
				t.Errorf("create_vm.wait_for: %s", mustJSON(wf))
			}
			for _, c := range []struct {
				prop     string
				min, max float64
			}{{"cpus", 1, 256}, {"memory_mib", 256, 0}, {"disk_gib", 1, 4096}} {
				p := schema.Properties[c.prop]
				if p.Type != "integer" || len(p.AnyOf) != 2 || p.AnyOf[0].Const == nil || (*p.AnyOf[0].Const).(float64) != 0 {
					t.Errorf("create_vm.%s: %s", c.prop, mustJSON(p))
					continue
				}
				b := p.AnyOf[1]
				if b.Minimum == nil || *b.Minimum != c.min || (c.max != 0 && (b.Maximum == nil || *b.Maximum != c.max)) {
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
			if (p.Minimum != nil && *p.Minimum >= 0) || p.Maximum == nil || *p.Maximum != 10000 || string(p.Default) != "100" {
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
		{"get_vm_console", map[string]any{"id": "0a1b2c3d", "lines": 20000}, `argument "lines": 20000 is more than the maximum 10000`},
		{"get_vm_console", map[string]any{"id": "0a1b2c3d", "lines": "ten"}, `argument "lines": want an integer, got a string`},
		{"forward_port", map[string]any{"id": "0a1b2c3d", "port": 0}, `argument "port": 0 is less than the minimum 1`},
		{"forward_port", map[string]any{"id": "0a1b2c3d", "port": 1.5}, `argument "port": want an integer, got a number`},
		{"create_vm", map[string]any{"name": "a", "wait_for": "forever"}, `argument "wait_for": "forever" is not one of none, installed, attested, ready`},
		{"create_network", map[string]any{"name": "n", "cidr": "10.0.0.0/24", "dns_policy": "closed"}, `argument "dns_policy": "closed" is not one of open, rules`},
		{"create_vm", map[string]any{"name": "a", "memory_mib": 128}, `argument "memory_mib": 128 is less than the minimum 256`},
		{"create_vm", map[string]any{"name": "a", "cpus": 300}, `argument "cpus": 300 is more than the maximum 256`},
		{"create_vm", map[string]any{"name": "a", "cpus": -1}, `argument "cpus": -1 is less than the minimum 1`},
		{"create_vm", map[string]any{"name": "a", "cpus": "2.5"}, `argument "cpus": want an integer, got a string`},
		{"create_vm", map[string]any{"name": "a", "memory_mib": "128"}, `argument "memory_mib": 128 is less than the minimum 256`},
		{"create_vm", map[string]any{"name": "a", "cpus": ""}, `argument "cpus": want an integer, got a string`},
		{"forward_port", map[string]any{"id": "0a1b2c3d", "port": "0"}, `argument "port": 0 is less than the minimum 1`},
		{"forward_port", map[string]any{"id": "0a1b2c3d", "port": "22 "}, `argument "port": want an integer, got a string`},
		{"forward_port", map[string]any{"id": "0a1b2c3d", "port": nil}, `missing required argument "port"`},
		{"create_network", map[string]any{"name": "n", "cidr": "10.0.0.0/24", "egress": []any{map[string]any{"cidr": "10.1.0.0/16", "port": []int{22}}}}, `arguments: egress: egress/items: unexpected additional properties ["port"]`},
		{"create_vm", map[string]any{"name": "a", "require_attestation": "true"}, `argument "require_attestation": want true or false, got a string`},
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
	if want := "{\n  \"stdout\": \"uname -r\\n\",\n  \"stderr\": \"\",\n  \"exitCode\": 3,\n  \"truncated\": false\n}\n"; got != want {
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
	// delete_network names the network as id, as the original's did.
	got = wantOK(t, h.call(t, "delete_network", map[string]any{"name": "lab"}))
	if want := "{\n  \"id\": \"lab\",\n  \"deleted\": true\n}\n"; got != want {
		t.Errorf("delete_network = %s, want %s", got, want)
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

// TestEveryToolCallsItsRPC: each tool but get_info is one backend call
// (the table in tools.go), its request built from the arguments.
func TestEveryToolCallsItsRPC(t *testing.T) {
	h := newHarness(t)
	id := map[string]any{"id": "0a1b2c3d"}
	for _, tc := range []struct {
		tool   string
		args   map[string]any
		method string
		req    proto.Message
	}{
		{"get_host", nil, "HypervisorService/GetHost", &hypervisorv1.GetHostRequest{}},
		{"list_images", nil, "HypervisorService/ListImages", &hypervisorv1.ListImagesRequest{}},
		{"get_image", map[string]any{"ref": "img_1"}, "HypervisorService/GetImage", &hypervisorv1.GetImageRequest{Ref: "img_1"}},
		{"list_networks", nil, "HypervisorService/ListNetworks", &hypervisorv1.ListNetworksRequest{}},
		{"get_network", map[string]any{"name": "n"}, "HypervisorService/GetNetwork", &hypervisorv1.GetNetworkRequest{Name: "n"}},
		{"list_vms", nil, "HypervisorService/ListVirtualMachines", &hypervisorv1.ListVirtualMachinesRequest{}},
		{"get_vm", id, "HypervisorService/GetVirtualMachine", &hypervisorv1.GetVirtualMachineRequest{Id: "0a1b2c3d"}},
		{"get_vm_console", map[string]any{"id": "0a1b2c3d", "lines": 7}, "HypervisorService/GetVirtualMachineConsole", &hypervisorv1.GetVirtualMachineConsoleRequest{Id: "0a1b2c3d", Lines: 7}},
		{"get_vm_metrics", id, "HypervisorService/GetVirtualMachineMetrics", &hypervisorv1.GetVirtualMachineMetricsRequest{Id: "0a1b2c3d"}},
		{"get_vm_attestation", id, "AttestationService/GetVirtualMachineAttestation", &attestationv1.GetVirtualMachineAttestationRequest{Id: "0a1b2c3d"}},
		{"create_network", map[string]any{"name": "n", "cidr": "10.0.0.0/24", "dns_search_domain": "lab"}, "HypervisorService/CreateNetwork",
			&hypervisorv1.CreateNetworkRequest{Name: "n", Cidr: "10.0.0.0/24", DnsSearchDomain: "lab", DnsPolicy: hypervisorv1.DnsPolicy_DNS_POLICY_OPEN}},
		{"create_network", map[string]any{"name": "n", "cidr": "10.0.0.0/24", "dns_policy": "rules",
			"egress":      []any{map[string]any{"cidr": "10.1.0.0/16", "ports": []int{22}}, map[string]any{"domain": "*.example.com", "ports": []int{443}}},
			"dns_records": []any{map[string]any{"name": "api.example.com", "ip": "192.0.2.10"}}}, "HypervisorService/CreateNetwork",
			&hypervisorv1.CreateNetworkRequest{Name: "n", Cidr: "10.0.0.0/24", DnsPolicy: hypervisorv1.DnsPolicy_DNS_POLICY_RULES,
				Egress:     []*hypervisorv1.EgressRule{{Cidr: "10.1.0.0/16", Ports: []uint32{22}}, {Domain: "*.example.com", Ports: []uint32{443}}},
				DnsRecords: []*hypervisorv1.DnsRecord{{Name: "api.example.com", Ip: "192.0.2.10"}}}},
		{"delete_network", map[string]any{"name": "n"}, "HypervisorService/DeleteNetwork", &hypervisorv1.DeleteNetworkRequest{Name: "n"}},
		{"start_vm", id, "HypervisorService/StartVirtualMachine", &hypervisorv1.StartVirtualMachineRequest{Id: "0a1b2c3d"}},
		{"stop_vm", id, "HypervisorService/StopVirtualMachine", &hypervisorv1.StopVirtualMachineRequest{Id: "0a1b2c3d"}},
		{"reboot_vm", id, "HypervisorService/RebootVirtualMachine", &hypervisorv1.RebootVirtualMachineRequest{Id: "0a1b2c3d"}},
		{"suspend_vm", id, "HypervisorService/SuspendVirtualMachine", &hypervisorv1.SuspendVirtualMachineRequest{Id: "0a1b2c3d"}},
		{"resume_vm", id, "HypervisorService/ResumeVirtualMachine", &hypervisorv1.ResumeVirtualMachineRequest{Id: "0a1b2c3d"}},
		{"delete_vm", id, "HypervisorService/DeleteVirtualMachine", &hypervisorv1.DeleteVirtualMachineRequest{Id: "0a1b2c3d"}},
		{"exec_vm", map[string]any{"id": "0a1b2c3d", "command": []string{"true"}}, "HypervisorService/ExecVirtualMachine", &hypervisorv1.ExecVirtualMachineRequest{Id: "0a1b2c3d", Command: []string{"true"}}},
		{"forward_port", map[string]any{"id": "0a1b2c3d", "port": 6443}, "HypervisorService/ForwardVirtualMachinePort", &hypervisorv1.ForwardVirtualMachinePortRequest{Id: "0a1b2c3d", Port: 6443}},
		{"create_vm", map[string]any{"name": "w", "ttl": "60s", "on_expire": "delete", "idle_timeout": "5m", "on_idle": "stop"}, "HypervisorService/CreateVirtualMachine",
			&hypervisorv1.CreateVirtualMachineRequest{Name: "w", Cpus: proto.Int32(2), MemoryMib: proto.Int32(2048), DiskGib: proto.Int32(20), RequireAttestation: proto.Bool(true), WaitFor: hypervisorv1.WaitFor_WAIT_FOR_READY, Ttl: "60s", OnExpire: hypervisorv1.OnExpire_ON_EXPIRE_DELETE, IdleTimeout: "5m", OnIdle: hypervisorv1.OnIdle_ON_IDLE_STOP}},
		{"create_vm", map[string]any{"name": "w", "expire_at": "2030-01-02T15:04:05Z"}, "HypervisorService/CreateVirtualMachine",
			&hypervisorv1.CreateVirtualMachineRequest{Name: "w", Cpus: proto.Int32(2), MemoryMib: proto.Int32(2048), DiskGib: proto.Int32(20), RequireAttestation: proto.Bool(true), WaitFor: hypervisorv1.WaitFor_WAIT_FOR_READY, ExpireAt: &timestamppb.Timestamp{Seconds: 1893596645}}},
		{"update_vm_lifetime", map[string]any{"id": "0a1b2c3d", "ttl": "2h", "on_expire": "stop", "idle_timeout": "0s"}, "HypervisorService/UpdateVirtualMachineLifetime",
			&hypervisorv1.UpdateVirtualMachineLifetimeRequest{Id: "0a1b2c3d", Ttl: "2h", OnExpire: hypervisorv1.OnExpire_ON_EXPIRE_STOP, IdleTimeout: proto.String("0s")}},
		{"update_vm_lifetime", map[string]any{"id": "0a1b2c3d", "clear_expiry": true}, "HypervisorService/UpdateVirtualMachineLifetime",
			&hypervisorv1.UpdateVirtualMachineLifetimeRequest{Id: "0a1b2c3d", ClearExpiry: true}},
	} {
		h.call(t, tc.tool, tc.args) // the fake leaves some unimplemented: any result will do
		if got := h.rpcs.last(); got.method != tc.method || !proto.Equal(got.req, tc.req) {
			t.Errorf("%s called %s %v, want %s %v", tc.tool, got.method, got.req, tc.method, tc.req)
		}
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
	// client dispatches them asynchronously: wait for the ready one, the
	// last the server sends.
	poll.Until(t, "the progress notification of the VM ready", func() bool {
		return slices.ContainsFunc(h.progressSeen(), func(p *mcp.ProgressNotificationParams) bool { return p.Message == "vm 0a1b2c3d is ready" })
	})
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
	// The watch drives the progress: nothing polls.
	h.rpcs.mu.Lock()
	defer h.rpcs.mu.Unlock()
	for _, c := range h.rpcs.calls {
		if c.method == "HypervisorService/ListVirtualMachines" || c.method == "HypervisorService/GetVirtualMachine" {
			t.Errorf("create_vm's progress polled: %s", c.method)
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

// TestToolsListStable: tools/list is the same, byte for byte and sorted by
// name, on every call and after a restart (a second server).
func TestToolsListStable(t *testing.T) {
	var lists []string
	for range 2 { // two servers
		h := newHarness(t)
		for range 3 {
			res, err := h.session.ListTools(context.Background(), nil)
			if err != nil {
				t.Fatal(err)
			}
			var names []string
			for _, tool := range res.Tools {
				names = append(names, tool.Name)
			}
			if !slices.IsSorted(names) || len(names) != len(ToolNames) {
				t.Fatalf("tools/list: %v", names)
			}
			lists = append(lists, mustJSON(res.Tools))
		}
	}
	t.Logf("tools/list: %d tools, %d bytes of JSON", len(ToolNames), len(lists[0]))
	for i, l := range lists {
		if l != lists[0] {
			t.Fatalf("tools/list %d differs from the first:\n%s\n%s", i, l, lists[0])
		}
	}
}
