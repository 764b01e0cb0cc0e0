package mcp

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/defaults"
	"google.golang.org/protobuf/proto"
)

// TestLenientArguments: arguments are taken as the original's mcp-go server
// took them. Undeclared ones are ignored, integers may come as strings, a
// null is an absent argument, and 0 or "" where it means the default is the
// default. Each call reaches the backend with the request an exact call
// would have made.
func TestLenientArguments(t *testing.T) {
	h := newHarness(t)
	id := "0a1b2c3d"
	ready := hypervisorv1.WaitFor_WAIT_FOR_READY
	yes := true
	defaults := func(name string) *hypervisorv1.CreateVirtualMachineRequest {
		return &hypervisorv1.CreateVirtualMachineRequest{Name: name, Cpus: proto.Int32(defaults.CPUs), MemoryMib: proto.Int32(defaults.MemoryMiB),
			DiskGib: proto.Int32(defaults.DiskGiB), RequireAttestation: &yes, WaitFor: ready}
	}
	sized := defaults("quick")
	sized.Cpus, sized.MemoryMib = proto.Int32(4), proto.Int32(1024)
	for _, tc := range []struct {
		name   string
		tool   string
		args   map[string]any
		method string
		req    proto.Message
	}{
		{"undeclared arguments", "get_vm", map[string]any{"id": id, "bogus": 1, "verbose": true, "filter": map[string]any{"x": nil}},
			"HypervisorService/GetVirtualMachine", &hypervisorv1.GetVirtualMachineRequest{Id: id}},
		{"undeclared arguments of a tool without any", "get_host", map[string]any{"bogus": "x"},
			"HypervisorService/GetHost", &hypervisorv1.GetHostRequest{}},
		{"a port as a string", "forward_port", map[string]any{"id": id, "port": "22"},
			"HypervisorService/ForwardVirtualMachinePort", &hypervisorv1.ForwardVirtualMachinePortRequest{Id: id, Port: 22}},
		{"lines as a string", "get_vm_console", map[string]any{"id": id, "lines": "50"},
			"HypervisorService/GetVirtualMachineConsole", &hypervisorv1.GetVirtualMachineConsoleRequest{Id: id, Lines: 50}},
		// The hypervisor reads 0 or less as the default, as REST's ?lines=.
		{"negative lines", "get_vm_console", map[string]any{"id": id, "lines": -5},
			"HypervisorService/GetVirtualMachineConsole", &hypervisorv1.GetVirtualMachineConsoleRequest{Id: id, Lines: -5}},
		{"null lines", "get_vm_console", map[string]any{"id": id, "lines": nil},
			"HypervisorService/GetVirtualMachineConsole", &hypervisorv1.GetVirtualMachineConsoleRequest{Id: id, Lines: 100}},
		{"zero sizes and an empty wait_for are the defaults", "create_vm", map[string]any{"name": "quick", "cpus": 0, "memory_mib": 0, "disk_gib": "0", "wait_for": ""},
			"HypervisorService/CreateVirtualMachine", defaults("quick")},
		{"sizes as strings, nulls, undeclared", "create_vm", map[string]any{"name": "quick", "cpus": "4", "memory_mib": "1024", "disk_gib": nil, "hostname": nil, "require_attestation": nil, "labels": map[string]any{"a": "b"}},
			"HypervisorService/CreateVirtualMachine", sized},
		{"an empty dns_policy, ports as strings", "create_network", map[string]any{"name": "n", "cidr": "10.0.0.0/24", "dns_policy": "", "egress": []any{map[string]any{"cidr": "10.1.0.0/16", "ports": []any{"22", 443}}}},
			"HypervisorService/CreateNetwork", &hypervisorv1.CreateNetworkRequest{Name: "n", Cidr: "10.0.0.0/24", DnsPolicy: hypervisorv1.DnsPolicy_DNS_POLICY_OPEN,
				Egress: []*hypervisorv1.EgressRule{{Cidr: "10.1.0.0/16", Ports: []uint32{22, 443}}}}},
		{"exec with an undeclared timeout", "exec_vm", map[string]any{"id": id, "command": []string{"true"}, "timeout": 5},
			"HypervisorService/ExecVirtualMachine", &hypervisorv1.ExecVirtualMachineRequest{Id: id, Command: []string{"true"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := h.call(t, tc.tool, tc.args)
			if res.IsError && len(res.Content) > 0 {
				if s := text(t, res); len(s) >= 16 && s[:16] == "invalid_request:" {
					t.Fatalf("refused: %s", s)
				}
			}
			if got := h.rpcs.last(); got.method != tc.method || !proto.Equal(got.req, tc.req) {
				t.Errorf("called %s %v\nwant   %s %v", got.method, got.req, tc.method, tc.req)
			}
		})
	}
}

// TestHostileArguments: leniency has its bounds. A call full of undeclared
// arguments is answered as if they were not there, and a body over
// MaxRequestBodyBytes is refused before it is read whole, for a JSON-only
// client as for an SSE one.
func TestHostileArguments(t *testing.T) {
	h, url := rawHarness(t)
	var b strings.Builder
	b.WriteString(`{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"get_vm_attestation","arguments":{"id":"0a1b2c3d"`)
	n := 0
	for b.Len() < MaxRequestBodyBytes-64 {
		fmt.Fprintf(&b, `,"x%d":[1,{"a":"%d"}]`, n, n)
		n++
	}
	b.WriteString(`}}}`)
	for _, accept := range []string{jsonOnly, both} {
		c := &rawMCP{t: t, url: url}
		c.initialize(accept)
		start := time.Now()
		r := c.post(accept, b.String())
		var res rpcResponse
		if accept == jsonOnly {
			res = jsonReply(t, r)
		} else {
			res = sseReply(t, r)[0]
		}
		if res.Result.IsError || res.Result.StructuredContent["required"] != true {
			t.Errorf("%s: %d undeclared arguments (%d bytes): %.300s", accept, n, b.Len(), r.body)
		}
		if got := h.rpcs.last(); !proto.Equal(got.req, &attestationv1.GetVirtualMachineAttestationRequest{Id: "0a1b2c3d"}) {
			t.Errorf("backend got %v", got.req)
		}
		t.Logf("%s: %d undeclared arguments in %d bytes answered in %v", accept, n, b.Len(), time.Since(start))

		over := `{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"get_vm","arguments":{"id":"0a1b2c3d","x":"` + strings.Repeat("a", MaxRequestBodyBytes) + `"}}}`
		if r := c.post(accept, over); r.status != http.StatusRequestEntityTooLarge {
			t.Errorf("%s: a body of %d bytes: %d %.200s", accept, len(over), r.status, r.body)
		}
	}
}

// TestInvalidUTF8Argument: invalid UTF-8 in an argument is refused, not
// turned into U+FFFD (REST refuses it too), whichever JSON-RPC decoder sees
// it first.
func TestInvalidUTF8Argument(t *testing.T) {
	h, url := rawHarness(t)
	c := &rawMCP{t: t, url: url}
	c.initialize(jsonOnly)
	r := c.post(jsonOnly, "{\"jsonrpc\":\"2.0\",\"id\":5,\"method\":\"tools/call\",\"params\":{\"name\":\"create_vm\",\"arguments\":{\"name\":\"quick\",\"metadata\":{\"k\":\"a\xffb\"}}}}")
	if r.status == http.StatusOK {
		if res := jsonReply(t, r); !res.Result.IsError || !strings.HasPrefix(res.Result.Content[0].Text, "invalid_request: arguments: invalid UTF-8") {
			t.Errorf("invalid UTF-8: %s", r.body)
		}
	} else if r.status != http.StatusBadRequest {
		t.Errorf("invalid UTF-8: %d %s", r.status, r.body)
	}
	if h.hv.lastCreate() != nil {
		t.Errorf("the backend got %v", h.hv.lastCreate())
	}
}
