package mcp

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/google/jsonschema-go/jsonschema"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/protobuf/proto"
)

// ForkVirtualMachine: count forks of the request's VM, as a node answers.
func (f *fakeHypervisor) ForkVirtualMachine(ctx context.Context, req *hypervisorv1.ForkVirtualMachineRequest) (*hypervisorv1.ForkVirtualMachineResponse, error) {
	f.record(ctx)
	resp := &hypervisorv1.ForkVirtualMachineResponse{PauseSeconds: 0.5}
	for i := range req.GetCount() {
		resp.Vms = append(resp.Vms, &hypervisorv1.VirtualMachine{
			Id: "0f0f000" + string(rune('1'+i)), Name: "w-fork-" + string(rune('1'+i)),
			State: hypervisorv1.State_STATE_READY, ForkedFrom: req.GetId(),
		})
	}
	return resp, nil
}

// TestForkVM: fork_vm is described so that an agent knows what a fork is
// and is not, its schema bounds count and wait_for, and it sends the
// request its arguments say, answering the forks.
func TestForkVM(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	res, err := h.session.ListTools(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(res.Tools, func(x *mcp.Tool) bool { return x.Name == "fork_vm" })
	if i < 0 {
		t.Fatal("no tool fork_vm")
	}
	tool := res.Tools[i]
	for _, w := range []string{"WRITES: ", "own vTPM with a fresh EK and AK", "names the parent in forkedFrom",
		"Disks are copy-on-write", "paused only while its snapshot is taken", "pauseSeconds", "parent's node"} {
		if !strings.Contains(tool.Description, w) {
			t.Errorf("description does not say %q:\n%s", w, tool.Description)
		}
	}
	b, _ := json.Marshal(tool.InputSchema)
	var schema jsonschema.Schema
	if err := json.Unmarshal(b, &schema); err != nil {
		t.Fatal(err)
	}
	if p := schema.Properties["count"]; len(p.AnyOf) != 2 || p.AnyOf[1].Minimum == nil || *p.AnyOf[1].Minimum != 1 ||
		p.AnyOf[1].Maximum == nil || *p.AnyOf[1].Maximum != 16 || string(p.Default) != "1" {
		t.Errorf("count: %s", mustJSON(p))
	}
	if p := schema.Properties["wait_for"]; !slices.Equal(p.Enum, []any{"none", "ready", ""}) || string(p.Default) != `"ready"` {
		t.Errorf("wait_for: %s", mustJSON(p))
	}

	for _, tc := range []struct {
		args map[string]any
		want *hypervisorv1.ForkVirtualMachineRequest
	}{
		{map[string]any{"id": "0a1b2c3d"}, &hypervisorv1.ForkVirtualMachineRequest{Id: "0a1b2c3d", Count: 1, WaitFor: hypervisorv1.WaitFor_WAIT_FOR_READY}},
		{map[string]any{"id": "0a1b2c3d", "count": 0, "wait_for": ""}, &hypervisorv1.ForkVirtualMachineRequest{Id: "0a1b2c3d", Count: 1, WaitFor: hypervisorv1.WaitFor_WAIT_FOR_READY}},
		{map[string]any{"id": "0a1b2c3d", "count": 3, "wait_for": "none"}, &hypervisorv1.ForkVirtualMachineRequest{Id: "0a1b2c3d", Count: 3, WaitFor: hypervisorv1.WaitFor_WAIT_FOR_NONE}},
	} {
		got := wantOK(t, h.call(t, "fork_vm", tc.args))
		if c := h.rpcs.last(); c.method != "HypervisorService/ForkVirtualMachine" || !proto.Equal(c.req, tc.want) {
			t.Errorf("fork_vm %v called %s %v, want %v", tc.args, c.method, c.req, tc.want)
		}
		var out struct {
			Vms []struct {
				Name       string `json:"name"`
				ForkedFrom string `json:"forkedFrom"`
			} `json:"vms"`
			PauseSeconds float64 `json:"pauseSeconds"`
		}
		if err := json.Unmarshal([]byte(got), &out); err != nil || len(out.Vms) != int(tc.want.Count) || out.PauseSeconds != 0.5 || out.Vms[0].ForkedFrom != "0a1b2c3d" {
			t.Errorf("fork_vm %v = %s (%v)", tc.args, got, err)
		}
	}

	// Out of the schema's bounds: refused before the backend is asked.
	n := h.rpcs.len()
	for _, args := range []map[string]any{{"id": "0a1b2c3d", "count": 17}, {"id": "0a1b2c3d", "wait_for": "attested"}} {
		wantError(t, h.call(t, "fork_vm", args), "invalid_request: ")
	}
	if h.rpcs.len() != n {
		t.Errorf("a refused fork_vm reached the backend: %v", h.rpcs.last())
	}
}

// len is how many calls were recorded.
func (l *rpcLog) len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.calls)
}
