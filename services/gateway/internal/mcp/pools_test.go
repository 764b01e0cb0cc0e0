package mcp

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/protobuf/proto"
)

// ListPools: one pool of the harness's backend.
func (f *fakeHypervisor) ListPools(ctx context.Context, _ *hypervisorv1.ListPoolsRequest) (*hypervisorv1.ListPoolsResponse, error) {
	f.record(ctx)
	return &hypervisorv1.ListPoolsResponse{Pools: []*hypervisorv1.Pool{{
		Name:   "warm",
		Shape:  &hypervisorv1.PoolShape{Image: "flatcar_4152.2.0", Cpus: 2, MemoryMib: 2048, DiskGib: 20, Network: "default", RequireAttestation: true},
		Size:   3,
		Status: &hypervisorv1.PoolStatus{Ready: 2, Filling: 1, HitsTotal: 7, DiskBytes: 3 << 30},
	}}}, nil
}

// TestPoolTools: an SDK client sees the five pool tools, described so that
// an agent knows create_vm claims from them, and list_pools answers the
// backend's pools.
func TestPoolTools(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	res, err := h.session.ListTools(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	tools := map[string]*mcp.Tool{}
	for _, tool := range res.Tools {
		tools[tool.Name] = tool
	}
	for name, want := range map[string][]string{
		"list_pools":  {"Read-only.", "create_vm with that shape claims one"},
		"get_pool":    {"Read-only.", "lastError"},
		"create_pool": {"WRITES:", "create_vm claims a ready member automatically", "skip_pool true boots a fresh VM", "give node"},
		"resize_pool": {"WRITES:", "shrinking deletes the ready members"},
		"delete_pool": {"WRITES (destructive):", "VMs already claimed from it are untouched"},
		"create_vm":   {"fromPool names the pool", "skip_pool true boots a fresh VM"},
	} {
		tool := tools[name]
		if tool == nil {
			t.Errorf("no tool %s", name)
			continue
		}
		for _, w := range want {
			if !strings.Contains(tool.Description, w) {
				t.Errorf("%s: description does not say %q:\n%s", name, w, tool.Description)
			}
		}
	}
	var in struct {
		Properties map[string]struct {
			Type string `json:"type"`
		} `json:"properties"`
	}
	b, _ := json.Marshal(tools["create_vm"].InputSchema)
	if err := json.Unmarshal(b, &in); err != nil || in.Properties["skip_pool"].Type != "boolean" {
		t.Errorf("create_vm has no boolean skip_pool: %s", b)
	}

	r := h.call(t, "list_pools", nil)
	got := wantOK(t, r)
	var pools []map[string]any
	if err := json.Unmarshal([]byte(got), &pools); err != nil {
		t.Fatalf("list_pools: %v\n%s", err, got)
	}
	if len(pools) != 1 || pools[0]["name"] != "warm" || pools[0]["size"] != float64(3) {
		t.Fatalf("list_pools = %s", got)
	}
	status, _ := pools[0]["status"].(map[string]any)
	if status["ready"] != float64(2) || status["hitsTotal"] != float64(7) || status["diskBytes"] != float64(3<<30) {
		t.Errorf("list_pools status = %v", status)
	}
	sc, _ := json.Marshal(r.StructuredContent)
	if !strings.HasPrefix(string(sc), `{"pools":[{"name":"warm"`) {
		t.Errorf("structuredContent = %s", sc)
	}
}

// TestPoolToolsCallTheirRPCs: as TestEveryToolCallsItsRPC, for the pool
// tools and create_vm's skip_pool.
func TestPoolToolsCallTheirRPCs(t *testing.T) {
	h := newHarness(t)
	for _, tc := range []struct {
		tool   string
		args   map[string]any
		method string
		req    proto.Message
	}{
		{"create_vm", map[string]any{"name": "w", "skip_pool": true}, "HypervisorService/CreateVirtualMachine",
			&hypervisorv1.CreateVirtualMachineRequest{Name: "w", Cpus: proto.Int32(2), MemoryMib: proto.Int32(2048), DiskGib: proto.Int32(20), RequireAttestation: proto.Bool(true), WaitFor: hypervisorv1.WaitFor_WAIT_FOR_READY, SkipPool: true}},
		{"list_pools", nil, "HypervisorService/ListPools", &hypervisorv1.ListPoolsRequest{}},
		{"list_pools", map[string]any{"node": "n1"}, "HypervisorService/ListPools", &hypervisorv1.ListPoolsRequest{Node: "n1"}},
		{"get_pool", map[string]any{"name": "p"}, "HypervisorService/GetPool", &hypervisorv1.GetPoolRequest{Name: "p"}},
		{"create_pool", map[string]any{"name": "p", "size": 3, "image": "img_1", "cpus": 4, "network": "lab", "require_attestation": false, "node": "n1"}, "HypervisorService/CreatePool",
			&hypervisorv1.CreatePoolRequest{Name: "p", Size: 3, Image: "img_1", Cpus: proto.Int32(4), MemoryMib: proto.Int32(2048), DiskGib: proto.Int32(20), Network: "lab", RequireAttestation: proto.Bool(false), Node: "n1"}},
		{"create_pool", map[string]any{"name": "p", "size": 0}, "HypervisorService/CreatePool",
			&hypervisorv1.CreatePoolRequest{Name: "p", Cpus: proto.Int32(2), MemoryMib: proto.Int32(2048), DiskGib: proto.Int32(20), RequireAttestation: proto.Bool(true)}},
		{"resize_pool", map[string]any{"name": "p", "size": "5"}, "HypervisorService/ResizePool", &hypervisorv1.ResizePoolRequest{Name: "p", Size: 5}},
		{"delete_pool", map[string]any{"name": "p"}, "HypervisorService/DeletePool", &hypervisorv1.DeletePoolRequest{Name: "p"}},
	} {
		h.call(t, tc.tool, tc.args) // the fake leaves some unimplemented: any result will do
		if got := h.rpcs.last(); got.method != tc.method || !proto.Equal(got.req, tc.req) {
			t.Errorf("%s called %s %v, want %s %v", tc.tool, got.method, got.req, tc.method, tc.req)
		}
	}
}
