package server

import (
	"reflect"
	"slices"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"google.golang.org/genproto/googleapis/api/annotations"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/giantswarm/vm-manager/services/gateway/internal/fleet"
	"github.com/giantswarm/vm-manager/services/gateway/internal/mcp"
)

// surfaces says, for every RPC of the public services, which MCP tool
// carries it ("" with a reason when none does) and why an RPC has no REST
// route when it has none. A new RPC fails TestEveryRPCIsWired until it is
// entered here: adding an RPC means deciding each surface (docs/development.md,
// "Adding an RPC").
var surfaces = map[string]struct{ tool, noTool, noREST string }{
	"HypervisorService/GetHost":                      {tool: "get_host"},
	"HypervisorService/ListImages":                   {tool: "list_images"},
	"HypervisorService/GetImage":                     {tool: "get_image"},
	"HypervisorService/ImportImage":                  {tool: "import_image"},
	"HypervisorService/ListNetworks":                 {tool: "list_networks"},
	"HypervisorService/GetNetwork":                   {tool: "get_network"},
	"HypervisorService/CreateNetwork":                {tool: "create_network"},
	"HypervisorService/DeleteNetwork":                {tool: "delete_network"},
	"HypervisorService/ListVirtualMachines":          {tool: "list_vms"},
	"HypervisorService/GetVirtualMachine":            {tool: "get_vm"},
	"HypervisorService/CreateVirtualMachine":         {tool: "create_vm"},
	"HypervisorService/DeleteVirtualMachine":         {tool: "delete_vm"},
	"HypervisorService/StartVirtualMachine":          {tool: "start_vm"},
	"HypervisorService/StopVirtualMachine":           {tool: "stop_vm"},
	"HypervisorService/RebootVirtualMachine":         {tool: "reboot_vm"},
	"HypervisorService/ExecVirtualMachine":           {tool: "exec_vm"},
	"HypervisorService/ForwardVirtualMachinePort":    {tool: "forward_port"},
	"HypervisorService/GetVirtualMachineConsole":     {tool: "get_vm_console"},
	"HypervisorService/GetVirtualMachineMetrics":     {tool: "get_vm_metrics"},
	"HypervisorService/GetVirtualMachineReport":      {noTool: "the guest's raw report: get_vm_metrics summarises it for agents"},
	"HypervisorService/UpdateVirtualMachineLifetime": {tool: "update_vm_lifetime"},
	"HypervisorService/SuspendVirtualMachine":        {tool: "suspend_vm"},
	"HypervisorService/ResumeVirtualMachine":         {tool: "resume_vm"},
	"HypervisorService/ForkVirtualMachine":           {tool: "fork_vm"},
	"HypervisorService/CreatePool":                   {tool: "create_pool"},
	"HypervisorService/ListPools":                    {tool: "list_pools"},
	"HypervisorService/GetPool":                      {tool: "get_pool"},
	"HypervisorService/ResizePool":                   {tool: "resize_pool"},
	"HypervisorService/DeletePool":                   {tool: "delete_pool"},
	"HypervisorService/WatchVirtualMachines":         {noTool: "a server stream: MCP tools answer once (agents poll get_vm)"},
	"HypervisorService/ExecVirtualMachineStream": {noTool: "an interactive bidirectional stream: exec_vm is the agents' exec",
		noREST: "a bidirectional stream: REST carries it as the /exec/ws WebSocket, served by the gateway itself"},
	"AttestationService/GetVirtualMachineAttestation": {tool: "get_vm_attestation"},
	"AttestationService/ListImagePolicies":            {noTool: "operator surface: golden values are managed with grpcurl or REST, not by agents"},
	"AttestationService/GetImagePolicy":               {noTool: "operator surface (see ListImagePolicies)"},
	"AttestationService/ImportImagePolicy":            {noTool: "operator surface (see ListImagePolicies)"},
	"AttestationService/RecordGolden":                 {noTool: "operator surface (see ListImagePolicies)"},
	"AttestationService/ClearGolden":                  {noTool: "operator surface (see ListImagePolicies)"},
	"AttestationService/GetAttestationStatus":         {noTool: "operator surface (see ListImagePolicies)"},
}

// Every RPC of the public services is served by the fleet router, has a REST
// route (or a reason), and an MCP tool (or a reason); every MCP tool named
// exists. The gateway's node mode forwards whole services by name
// (internal/proxy), so it has no per-RPC gap to check.
func TestEveryRPCIsWired(t *testing.T) {
	tools := mcp.ToolNames
	seen := map[string]bool{}
	for _, c := range []struct {
		desc  grpc.ServiceDesc
		fleet any
	}{
		{hypervisorv1.HypervisorService_ServiceDesc, &fleet.Hypervisor{}},
		{attestationv1.AttestationService_ServiceDesc, &fleet.Attestation{}},
	} {
		sd, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(c.desc.ServiceName))
		if err != nil {
			t.Fatal(err)
		}
		svc := sd.(protoreflect.ServiceDescriptor)
		short := string(svc.Name())
		fleetType := reflect.TypeOf(c.fleet)
		for i := range svc.Methods().Len() {
			m := svc.Methods().Get(i)
			name := short + "/" + string(m.Name())
			seen[name] = true
			s, ok := surfaces[name]
			if !ok {
				t.Errorf("%s: not in surfaces: decide its fleet route, REST route and MCP tool (docs/development.md, Adding an RPC)", name)
				continue
			}
			// Methods promoted from an embedded Unimplemented server would
			// count here; the fleet types embed the Unsafe interfaces instead.
			if _, ok := fleetType.MethodByName(string(m.Name())); !ok {
				t.Errorf("%s: the fleet router (%s) does not serve it", name, fleetType)
			}
			rule, _ := proto.GetExtension(m.Options(), annotations.E_Http).(*annotations.HttpRule)
			switch {
			case rule == nil && s.noREST == "":
				t.Errorf("%s: no REST route (google.api.http) and no reason for none", name)
			case rule != nil && s.noREST != "":
				t.Errorf("%s: has a REST route but surfaces says %q", name, s.noREST)
			}
			switch {
			case s.tool == "" && s.noTool == "":
				t.Errorf("%s: no MCP tool and no reason for none", name)
			case s.tool != "" && !slices.Contains(tools, s.tool):
				t.Errorf("%s: MCP tool %q is not registered (tools: %v)", name, s.tool, tools)
			}
		}
	}
	for name := range surfaces {
		if !seen[name] {
			t.Errorf("surfaces lists %s, which no service has", name)
		}
	}
}
