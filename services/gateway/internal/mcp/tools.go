package mcp

import (
	"context"
	"fmt"
	"log/slog"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// ToolNames are the tools in registration order: the reads, then the writes.
var ToolNames = []string{
	"get_info",
	"get_host",
	"list_images",
	"get_image",
	"list_networks",
	"get_network",
	"list_vms",
	"get_vm",
	"get_vm_console",
	"get_vm_metrics",
	"get_vm_attestation",
	"create_network",
	"delete_network",
	"create_vm",
	"start_vm",
	"stop_vm",
	"reboot_vm",
	"delete_vm",
	"exec_vm",
	"forward_port",
}

const (
	hypervisor  = "hypervisor"
	attestation = "attestation"
)

type tools struct {
	hv  hypervisorv1.HypervisorServiceClient
	at  attestationv1.AttestationServiceClient
	log *slog.Logger
}

// Argument types. The json name is the argument, a field without omitempty
// is required, the jsonschema tag is its description and the schema tag its
// bounds (see inputSchema).
type (
	noArgs struct{}

	imageArgs struct {
		Ref string `json:"ref" jsonschema:"the image: \"<id>_<version>\", or the bare id for its newest version"`
	}

	networkArgs struct {
		Name string `json:"name" jsonschema:"the network name"`
	}

	vmArgs struct {
		ID string `json:"id" jsonschema:"the VM id (8 hex characters)"`
	}

	consoleArgs struct {
		ID    string `json:"id" jsonschema:"the VM id (8 hex characters)"`
		Lines int32  `json:"lines,omitempty" jsonschema:"how many of the last console lines to return (default 100, also for 0, as REST's ?lines=0; at most 10000)" schema:"min=0,max=10000,default=100"`
	}

	createNetworkArgs struct {
		Name            string `json:"name" jsonschema:"a DNS label of at most 63 characters"`
		CIDR            string `json:"cidr" jsonschema:"IPv4 CIDR with a /16 to /29 prefix, outside 169.254.0.0/16; the gateway is the first host address"`
		DNSSearchDomain string `json:"dns_search_domain,omitempty" jsonschema:"DNS search domain handed to guests over DHCP"`
	}

	createVMArgs struct {
		Name               string            `json:"name" jsonschema:"a DNS label of at most 63 characters, unique among VMs"`
		Image              string            `json:"image,omitempty" jsonschema:"\"<id>_<version>\" or the bare id; default: the newest version of the newest image"`
		KubernetesVersion  string            `json:"kubernetes_version,omitempty" jsonschema:"one of the image's kubernetesVersions; default: the newest it offers"`
		CPUs               *int32            `json:"cpus,omitempty" jsonschema:"virtual CPUs, 1 to 256 (default 2)" schema:"min=1,max=256,default=2"`
		MemoryMiB          *int32            `json:"memory_mib,omitempty" jsonschema:"memory in MiB, at least 256 (default 2048)" schema:"min=256,default=2048"`
		DiskGiB            *int32            `json:"disk_gib,omitempty" jsonschema:"disk size in GiB, 1 to 4096 (default 20)" schema:"min=1,max=4096,default=20"`
		Network            string            `json:"network,omitempty" jsonschema:"the network to attach to (default \"default\")"`
		UserData           string            `json:"user_data,omitempty" jsonschema:"Ignition JSON (CAPI's bootstrap Secret), released to the guest only after a verified initrd quote, or at the start of the installed boot when require_attestation is false"`
		SSHAuthorizedKeys  []string          `json:"ssh_authorized_keys,omitempty" jsonschema:"single-line SSH public keys for root, appended after vm-manager's own per-VM key"`
		Hostname           string            `json:"hostname,omitempty" jsonschema:"a DNS label (default: name)"`
		Metadata           map[string]string `json:"metadata,omitempty" jsonschema:"served by the IMDS as /metadata/<key>; keys must be non-empty and contain no '/', space, tab or newline"`
		RequireAttestation *bool             `json:"require_attestation,omitempty" jsonschema:"hold user_data back until the guest's initrd quote is verified (default true)" schema:"default=true"`
		WaitFor            string            `json:"wait_for,omitempty" jsonschema:"what to block for: none (the installer started), installed, attested (user_data released) or ready (READY=1, the default)" schema:"enum=none|installed|attested|ready,default=\"ready\""`
	}

	execArgs struct {
		ID      string   `json:"id" jsonschema:"the VM id (8 hex characters)"`
		Command []string `json:"command" jsonschema:"the command and its arguments, run as root in the guest; not empty" schema:"minItems=1"`
	}

	forwardArgs struct {
		ID   string `json:"id" jsonschema:"the VM id (8 hex characters)"`
		Port int32  `json:"port" jsonschema:"the guest TCP port, 1 to 65535 (for example 6443 for the Kubernetes API)" schema:"min=1,max=65535"`
	}
)

var waitFor = map[string]hypervisorv1.WaitFor{
	"":          hypervisorv1.WaitFor_WAIT_FOR_UNSPECIFIED,
	"none":      hypervisorv1.WaitFor_WAIT_FOR_NONE,
	"installed": hypervisorv1.WaitFor_WAIT_FOR_INSTALLED,
	"attested":  hypervisorv1.WaitFor_WAIT_FOR_ATTESTED,
	"ready":     hypervisorv1.WaitFor_WAIT_FOR_READY,
}

func (t *tools) register(s *mcp.Server) {
	log := t.log

	// Reads.
	addTool(s, log, "get_info", hintRead,
		`Read-only. This server's build: {version, commit, built, tools[]}; version is "dev" for a local build.`,
		"gateway", func(context.Context, *mcp.CallToolRequest, *noArgs) (any, error) {
			return BuildInfo(), nil
		})
	addTool(s, log, "get_host", hintRead,
		"Read-only. Host capabilities: hostname, kernel, CPUs, memory, /dev/kvm and /dev/vhost-vsock access, QEMU, swtpm and systemd versions, the OVMF firmware, storage providers, whether the host is ready and what is missing. Call it before creating VMs.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, _ *noArgs) (any, error) {
			return t.hv.GetHost(ctx, &hypervisorv1.GetHostRequest{})
		})
	addTool(s, log, "list_images", hintRead,
		"Read-only. The image catalog, sorted by id, newest version first, each with its Kubernetes versions. Empty means no image was built or --image-dir is wrong; create_vm needs at least one.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, _ *noArgs) (any, error) {
			resp, err := t.hv.ListImages(ctx, &hypervisorv1.ListImagesRequest{})
			if err != nil {
				return nil, err
			}
			return nonNil(resp.GetImages()), nil
		})
	addTool(s, log, "get_image", hintRead,
		"Read-only. Describe one image: UKI, disk, Kubernetes versions (newest first) and its attestation policy. Call list_images first.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, in *imageArgs) (any, error) {
			return t.hv.GetImage(ctx, &hypervisorv1.GetImageRequest{Ref: in.Ref})
		})
	addTool(s, log, "list_networks", hintRead,
		`Read-only. Networks with their gateway and DHCP leases, sorted by name; the server creates "default" at startup.`,
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, _ *noArgs) (any, error) {
			resp, err := t.hv.ListNetworks(ctx, &hypervisorv1.ListNetworksRequest{})
			if err != nil {
				return nil, err
			}
			return nonNil(resp.GetNetworks()), nil
		})
	addTool(s, log, "get_network", hintRead,
		"Read-only. One network: its spec, gateway and leases.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, in *networkArgs) (any, error) {
			return t.hv.GetNetwork(ctx, &hypervisorv1.GetNetworkRequest{Name: in.Name})
		})
	addTool(s, log, "list_vms", hintRead,
		"Read-only. Every VM record, oldest first.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, _ *noArgs) (any, error) {
			resp, err := t.hv.ListVirtualMachines(ctx, &hypervisorv1.ListVirtualMachinesRequest{})
			if err != nil {
				return nil, err
			}
			return nonNil(resp.GetVms()), nil
		})
	addTool(s, log, "get_vm", hintRead,
		"Read-only. One VM record. States: creating, installing (the installer copies the OS), booting (the installed boot), attesting (the guest fetched its first nonce), ready (READY=1), running (up, but no READY=1 within the boot timeout), stopping, stopped, failed (lastError says why), deleting. Poll it after create_vm with wait_for none, start_vm or reboot_vm.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, in *vmArgs) (any, error) {
			return t.hv.GetVirtualMachine(ctx, &hypervisorv1.GetVirtualMachineRequest{Id: in.ID})
		})
	addTool(s, log, "get_vm_console", hintRead,
		"Read-only. The last lines of the VM's serial console (default 100, at most 10000); empty before any output. The first place to look when a VM is failed or stuck.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, in *consoleArgs) (any, error) {
			return t.hv.GetVirtualMachineConsole(ctx, &hypervisorv1.GetVirtualMachineConsoleRequest{Id: in.ID, Lines: in.Lines})
		})
	addTool(s, log, "get_vm_metrics", hintRead,
		"Read-only. Host and guest metrics summary: state, attestation, CPU seconds, memory, disk and network bytes, install and boot-to-ready times, and a sample of the guest's last systemd-report upload. The full upload is REST-only at raw_report_url.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, in *vmArgs) (any, error) {
			return t.hv.GetVirtualMachineMetrics(ctx, &hypervisorv1.GetVirtualMachineMetricsRequest{Id: in.ID})
		})
	addTool(s, log, "get_vm_attestation", hintRead,
		"Read-only. The current boot's attestation verdicts: the initrd and ready quotes and whether user_data was released. Reset on every installed boot.",
		attestation, func(ctx context.Context, _ *mcp.CallToolRequest, in *vmArgs) (any, error) {
			return t.at.GetVirtualMachineAttestation(ctx, &attestationv1.GetVirtualMachineAttestationRequest{Id: in.ID})
		})

	// Writes.
	addTool(s, log, "create_network", hintCreate,
		"WRITES: create a network: a bridge with DHCP, NAT and the IMDS at 169.254.169.254. name is a DNS label of at most 63 characters; cidr is IPv4 with a /16 to /29 prefix outside 169.254.0.0/16, and the gateway is its first host address. Conflict if the name is taken.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, in *createNetworkArgs) (any, error) {
			return t.hv.CreateNetwork(ctx, &hypervisorv1.CreateNetworkRequest{Name: in.Name, Cidr: in.CIDR, DnsSearchDomain: in.DNSSearchDomain})
		})
	addTool(s, log, "delete_network", hintDestructive,
		"WRITES (destructive): delete a network. Conflict while any VM, running or stopped, is attached to it. Returns {name, deleted}.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, in *networkArgs) (any, error) {
			resp, err := t.hv.DeleteNetwork(ctx, &hypervisorv1.DeleteNetworkRequest{Name: in.Name})
			if err != nil {
				return nil, err
			}
			if resp.GetName() == "" {
				resp = &hypervisorv1.DeleteNetworkResponse{Name: in.Name}
			}
			resp.Deleted = true
			return resp, nil
		})
	addTool(s, log, "create_vm", hintCreate,
		`WRITES: create a VM and boot it. Call get_host, list_images and create_network (or use the "default" network) first. Blocks per wait_for: none (the installer started), installed, attested (user_data released) or ready (READY=1, the default). A timeout error still leaves the VM running. A failure returns the VM id: follow it with get_vm and get_vm_console, delete it with delete_vm. Sends progress notifications when the request carries a progress token.`,
		hypervisor, t.createVM)
	addTool(s, log, "start_vm", hintIdempotent,
		"WRITES: boot a stopped or failed VM from its disk; attestation runs again. Returns the VM in state booting. Conflict if it is running or was never installed.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, in *vmArgs) (any, error) {
			return t.hv.StartVirtualMachine(ctx, &hypervisorv1.StartVirtualMachineRequest{Id: in.ID})
		})
	addTool(s, log, "stop_vm", hintIdempotent,
		"WRITES: stop a VM: ACPI power-down, then SIGTERM, then SIGKILL after the stop timeout. The disk is kept; start_vm boots it again.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, in *vmArgs) (any, error) {
			return t.hv.StopVirtualMachine(ctx, &hypervisorv1.StopVirtualMachineRequest{Id: in.ID})
		})
	addTool(s, log, "reboot_vm", hintIdempotent,
		"WRITES: reboot a VM: stop_vm then start_vm. Returns the VM in state booting; poll get_vm.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, in *vmArgs) (any, error) {
			return t.hv.RebootVirtualMachine(ctx, &hypervisorv1.RebootVirtualMachineRequest{Id: in.ID})
		})
	addTool(s, log, "delete_vm", hintDestructive,
		"WRITES (destructive): delete a VM: stop it, then remove its disk, vTPM, lease, port forwards and record. Not undoable. Returns {id, deleted}.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, in *vmArgs) (any, error) {
			resp, err := t.hv.DeleteVirtualMachine(ctx, &hypervisorv1.DeleteVirtualMachineRequest{Id: in.ID})
			if err != nil {
				return nil, err
			}
			if resp.GetId() == "" {
				resp = &hypervisorv1.DeleteVirtualMachineResponse{Id: in.ID}
			}
			resp.Deleted = true
			return resp, nil
		})
	addTool(s, log, "exec_vm", hintExec,
		"WRITES (destructive): run a command in the guest as root, over ssh through the virtual network with the per-VM key; the guest's host key is pinned on first use. Returns {stdout, stderr, exitCode}; a non-zero exit is a result, not an error.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, in *execArgs) (any, error) {
			return t.hv.ExecVirtualMachine(ctx, &hypervisorv1.ExecVirtualMachineRequest{Id: in.ID, Command: in.Command})
		})
	addTool(s, log, "forward_port", hintIdempotent,
		"WRITES: expose a guest TCP port (for example 6443, the Kubernetes API) on a host loopback address 127.0.0.1:<port>. Returns {id, port, address}; the forward lives until the VM is deleted.",
		hypervisor, func(ctx context.Context, _ *mcp.CallToolRequest, in *forwardArgs) (any, error) {
			return t.hv.ForwardVirtualMachinePort(ctx, &hypervisorv1.ForwardVirtualMachinePortRequest{Id: in.ID, Port: in.Port})
		})
}

// nonNil makes an empty list marshal as [] rather than null.
func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

// createVM calls CreateVirtualMachine, which blocks per wait_for, and while
// it runs reports the VM's state changes as progress notifications when the
// client asked for them.
func (t *tools) createVM(ctx context.Context, req *mcp.CallToolRequest, in *createVMArgs) (any, error) {
	wf, ok := waitFor[in.WaitFor]
	if !ok { // the schema's enum catches this first
		return nil, errInvalid{fmt.Errorf("wait_for: %q is not one of none, installed, attested, ready", in.WaitFor)}
	}
	creq := &hypervisorv1.CreateVirtualMachineRequest{
		Name:               in.Name,
		Image:              in.Image,
		KubernetesVersion:  in.KubernetesVersion,
		Cpus:               in.CPUs,
		MemoryMib:          in.MemoryMiB,
		DiskGib:            in.DiskGiB,
		Network:            in.Network,
		UserData:           in.UserData,
		SshAuthorizedKeys:  in.SSHAuthorizedKeys,
		Hostname:           in.Hostname,
		Metadata:           in.Metadata,
		RequireAttestation: in.RequireAttestation,
		WaitFor:            wf,
	}
	var token any
	if req != nil && req.Params != nil {
		token = req.Params.GetProgressToken()
	}
	if token == nil || req.Session == nil {
		return t.hv.CreateVirtualMachine(ctx, creq)
	}
	p := newProgress(t.hv, req.Session, token, in.Name, t.log)
	stop := p.start(ctx)
	vm, err := t.hv.CreateVirtualMachine(ctx, creq)
	stop(vm)
	return vm, err
}
