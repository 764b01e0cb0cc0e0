package mcp

import (
	"context"
	"fmt"
	"log/slog"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// ToolNames are the tools in registration order (toolDefs): the reads, then
// the writes, as get_info lists them; tools/list sorts them by name.
var ToolNames []string

func init() {
	// Not an initializer: get_info's body reads ToolNames.
	for _, d := range toolDefs {
		ToolNames = append(ToolNames, d.name)
	}
}

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

	hostArgs struct {
		Node string `json:"node,omitempty" jsonschema:"fleet gateway only: this node's report; without it a fleet answers its summary (totals and fleetNodes, a line per node)"`
	}

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
		Lines int32  `json:"lines,omitempty" jsonschema:"how many of the last console lines to return: at most 10000, default 100 (also for 0 or less, as REST's ?lines=)" schema:"max=10000,default=100"`
	}

	createNetworkArgs struct {
		Name            string         `json:"name" jsonschema:"a DNS label of at most 63 characters"`
		CIDR            string         `json:"cidr" jsonschema:"IPv4 CIDR with a /16 to /29 prefix, outside 169.254.0.0/16; the gateway is the first host address"`
		DNSSearchDomain string         `json:"dns_search_domain,omitempty" jsonschema:"DNS search domain handed to guests over DHCP"`
		Egress          []egressArg    `json:"egress,omitempty" jsonschema:"what guests may reach through the NAT (at most 64 rules); empty: everything but loopback, private, shared, link-local and reserved ranges"`
		DNSRecords      []dnsRecordArg `json:"dns_records,omitempty" jsonschema:"A records the network's DNS answers itself (at most 64)"`
		DNSPolicy       string         `json:"dns_policy,omitempty" jsonschema:"open (the default): the network's DNS resolves every name; rules: only its records and names matching a domain rule, other lookups are refused" schema:"enum=open|rules,default=\"open\",zero"`
	}

	egressArg struct {
		CIDR   string   `json:"cidr,omitempty" jsonschema:"an IPv4 CIDR; give cidr or domain"`
		Domain string   `json:"domain,omitempty" jsonschema:"a DNS name, or *.name for every name below it: the addresses the network's DNS answers for it are allowed"`
		Ports  []uint32 `json:"ports,omitempty" jsonschema:"TCP/UDP ports; empty: all ports and protocols"`
	}

	dnsRecordArg struct {
		Name string `json:"name" jsonschema:"a DNS name, no wildcard"`
		IP   string `json:"ip" jsonschema:"an IPv4 address"`
	}

	createVMArgs struct {
		Name               string            `json:"name" jsonschema:"a DNS label of at most 63 characters, unique among VMs"`
		Image              string            `json:"image,omitempty" jsonschema:"\"<id>_<version>\" or the bare id; default: the newest version of the newest image"`
		KubernetesVersion  string            `json:"kubernetes_version,omitempty" jsonschema:"one of the image's kubernetesVersions; default: the newest it offers"`
		CPUs               *int32            `json:"cpus,omitempty" jsonschema:"virtual CPUs, 1 to 256; 0 or absent: the default" schema:"min=1,max=256,default=@cpus,zero"`
		MemoryMiB          *int32            `json:"memory_mib,omitempty" jsonschema:"memory in MiB, at least 256; 0 or absent: the default" schema:"min=256,default=@memoryMiB,zero"`
		DiskGiB            *int32            `json:"disk_gib,omitempty" jsonschema:"disk size in GiB, 1 to 4096; 0 or absent: the default" schema:"min=1,max=4096,default=@diskGiB,zero"`
		Network            string            `json:"network,omitempty" jsonschema:"the network to attach to (default \"default\")"`
		UserData           string            `json:"user_data,omitempty" jsonschema:"Ignition JSON (CAPI's bootstrap Secret), released to the guest only after a verified initrd quote, or at the start of the installed boot when require_attestation is false"`
		SSHAuthorizedKeys  []string          `json:"ssh_authorized_keys,omitempty" jsonschema:"single-line SSH public keys for root, appended after vm-manager's own per-VM key"`
		Hostname           string            `json:"hostname,omitempty" jsonschema:"a DNS label (default: name)"`
		Metadata           map[string]string `json:"metadata,omitempty" jsonschema:"served by the IMDS as /metadata/<key>; keys must be non-empty and contain no '/', space, tab or newline"`
		RequireAttestation *bool             `json:"require_attestation,omitempty" jsonschema:"hold user_data back until the guest's initrd quote is verified (default true)" schema:"default=true"`
		WaitFor            string            `json:"wait_for,omitempty" jsonschema:"what to block for: none (the installer started), installed, attested (user_data released) or ready (READY=1, the default, also for \"\")" schema:"enum=none|installed|attested|ready,default=\"ready\",zero"`
		Node               string            `json:"node,omitempty" jsonschema:"fleet gateway only: the node to create on (get_host lists them); default: placement by free memory and CPUs"`
		NodeSelector       string            `json:"node_selector,omitempty" jsonschema:"fleet gateway only: place among nodes whose labels match all of k=v,..."`
		SkipPool           bool              `json:"skip_pool,omitempty" jsonschema:"boot a fresh VM even when a warm pool (list_pools) holds a ready member of this shape; default false: such a member is claimed"`
		lifetimeArgs
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

// dnsPolicy is create_network's dns_policy; the schema's enum refuses others.
var dnsPolicy = map[string]hypervisorv1.DnsPolicy{
	"":      hypervisorv1.DnsPolicy_DNS_POLICY_UNSPECIFIED,
	"open":  hypervisorv1.DnsPolicy_DNS_POLICY_OPEN,
	"rules": hypervisorv1.DnsPolicy_DNS_POLICY_RULES,
}

var waitFor = map[string]hypervisorv1.WaitFor{
	"":          hypervisorv1.WaitFor_WAIT_FOR_UNSPECIFIED,
	"none":      hypervisorv1.WaitFor_WAIT_FOR_NONE,
	"installed": hypervisorv1.WaitFor_WAIT_FOR_INSTALLED,
	"attested":  hypervisorv1.WaitFor_WAIT_FOR_ATTESTED,
	"ready":     hypervisorv1.WaitFor_WAIT_FOR_READY,
}

type (
	hvc = hypervisorv1.HypervisorServiceClient
	atc = attestationv1.AttestationServiceClient
)

func hv(t *tools) hvc { return t.hv }
func at(t *tools) atc { return t.at }

// toolDefs are the contract's tools (§2) in registration order: the
// reads, then the writes. Most are one backend call: call builds its
// request from the arguments and returns its response, list returns the
// list in it.
var toolDefs = []toolDef{
	// Reads.
	{"get_info", hintRead, `Read-only. This server's build: {version, commit, built, tools[]}; version is "dev" for a local build.`,
		run(func(*tools, context.Context, *mcp.CallToolRequest, *noArgs) (Info, error) { return BuildInfo(), nil })},
	{"get_host", hintRead, "Read-only. Host capabilities: hostname, kernel, CPUs, memory, /dev/kvm and /dev/vhost-vsock access, QEMU, swtpm and systemd versions, the OVMF firmware, storage providers, whether the host is ready and what is missing. Call it before creating VMs.",
		call(hv, hvc.GetHost, func(in *hostArgs) *hypervisorv1.GetHostRequest { return &hypervisorv1.GetHostRequest{Node: in.Node} })},
	{"list_images", hintRead, "Read-only. The image catalog, sorted by id, newest version first, each with its Kubernetes versions. Empty means no image was built or --image-dir is wrong; create_vm needs at least one.",
		list(hv, hvc.ListImages, none[hypervisorv1.ListImagesRequest], (*hypervisorv1.ListImagesResponse).GetImages)},
	{"get_image", hintRead, "Read-only. Describe one image: UKI, disk, Kubernetes versions (newest first) and its attestation policy. Call list_images first.",
		call(hv, hvc.GetImage, func(in *imageArgs) *hypervisorv1.GetImageRequest { return &hypervisorv1.GetImageRequest{Ref: in.Ref} })},
	{"list_networks", hintRead, `Read-only. Networks with their gateway and DHCP leases, sorted by name; the server creates "default" at startup.`,
		list(hv, hvc.ListNetworks, none[hypervisorv1.ListNetworksRequest], (*hypervisorv1.ListNetworksResponse).GetNetworks)},
	{"get_network", hintRead, "Read-only. One network: its spec, gateway and leases.",
		call(hv, hvc.GetNetwork, func(in *networkArgs) *hypervisorv1.GetNetworkRequest {
			return &hypervisorv1.GetNetworkRequest{Name: in.Name}
		})},
	{"list_vms", hintRead, "Read-only. Every VM record, oldest first.",
		list(hv, hvc.ListVirtualMachines, none[hypervisorv1.ListVirtualMachinesRequest], (*hypervisorv1.ListVirtualMachinesResponse).GetVms)},
	{"get_vm", hintRead, "Read-only. One VM record. States: creating, installing (the installer copies the OS), booting (the installed boot), attesting (the guest fetched its first nonce), ready (READY=1), running (up, but no READY=1 within the boot timeout), stopping, stopped, failed (lastError says why), deleting, suspending, suspended (saved to disk; resume_vm). Poll it after create_vm with wait_for none, start_vm or reboot_vm.",
		call(hv, hvc.GetVirtualMachine, vmRequest[hypervisorv1.GetVirtualMachineRequest])},
	{"get_vm_console", hintRead, "Read-only. The last lines of the VM's serial console (default 100, at most 10000); empty before any output. The first place to look when a VM is failed or stuck.",
		call(hv, hvc.GetVirtualMachineConsole, func(in *consoleArgs) *hypervisorv1.GetVirtualMachineConsoleRequest {
			return &hypervisorv1.GetVirtualMachineConsoleRequest{Id: in.ID, Lines: in.Lines}
		})},
	{"get_vm_metrics", hintRead, "Read-only. Host and guest metrics summary: state, attestation, CPU seconds, memory, disk and network bytes, install and boot-to-ready times, and a sample of the guest's last systemd-report upload. The full upload is REST-only at raw_report_url.",
		call(hv, hvc.GetVirtualMachineMetrics, vmRequest[hypervisorv1.GetVirtualMachineMetricsRequest])},
	{"get_vm_attestation", hintRead, "Read-only. The current boot's attestation verdicts: the initrd and ready quotes and whether user_data was released. Reset on every installed boot.",
		call(at, atc.GetVirtualMachineAttestation, vmRequest[attestationv1.GetVirtualMachineAttestationRequest])},

	// Writes.
	{"create_network", hintCreate, "WRITES: create a network: a bridge with DHCP, NAT and the IMDS at 169.254.169.254. name is a DNS label of at most 63 characters; cidr is IPv4 with a /16 to /29 prefix outside 169.254.0.0/16, and the gateway is its first host address. egress rules (cidr or domain, with ports) say what guests reach through the NAT; dns_records and dns_policy shape the network's DNS. Conflict if the name is taken.",
		call(hv, hvc.CreateNetwork, func(in *createNetworkArgs) *hypervisorv1.CreateNetworkRequest {
			req := &hypervisorv1.CreateNetworkRequest{Name: in.Name, Cidr: in.CIDR, DnsSearchDomain: in.DNSSearchDomain, DnsPolicy: dnsPolicy[in.DNSPolicy]}
			for _, r := range in.Egress {
				req.Egress = append(req.Egress, &hypervisorv1.EgressRule{Cidr: r.CIDR, Domain: r.Domain, Ports: r.Ports})
			}
			for _, r := range in.DNSRecords {
				req.DnsRecords = append(req.DnsRecords, &hypervisorv1.DnsRecord{Name: r.Name, Ip: r.IP})
			}
			return req
		})},
	{"delete_network", hintDestructive, "WRITES (destructive): delete a network. Conflict while any VM, running or stopped, is attached to it. Returns {id, deleted}, id being the network's name.",
		run((*tools).deleteNetwork)},
	{"create_vm", hintCreate, `WRITES: create a VM and boot it. Call get_host, list_images and create_network (or use the "default" network) first. Blocks per wait_for: none (the installer started), installed, attested (user_data released) or ready (READY=1, the default). A timeout error still leaves the VM running. A failure returns the VM id: follow it with get_vm and get_vm_console, delete it with delete_vm. When a warm pool (list_pools) has a ready member whose shape (image, kubernetes_version, cpus, memory_mib, disk_gib, network, require_attestation, defaults filled in) equals this create's, the create claims it and resumes it in seconds instead of booting: the result's fromPool names the pool; skip_pool true boots a fresh VM instead. Behind a fleet gateway only a create naming node claims, from that node's pools. Sends progress notifications when the request carries a progress token.`,
		run((*tools).createVM)},
	{"start_vm", hintIdempotent, "WRITES: boot a stopped or failed VM from its disk; attestation runs again. Returns the VM in state booting. Conflict if it is running or was never installed.",
		call(hv, hvc.StartVirtualMachine, vmRequest[hypervisorv1.StartVirtualMachineRequest])},
	{"stop_vm", hintIdempotent, "WRITES: stop a VM: ACPI power-down, then SIGTERM, then SIGKILL after the stop timeout. The disk is kept; start_vm boots it again.",
		call(hv, hvc.StopVirtualMachine, vmRequest[hypervisorv1.StopVirtualMachineRequest])},
	{"reboot_vm", hintIdempotent, "WRITES: reboot a VM: stop_vm then start_vm. Returns the VM in state booting; poll get_vm.",
		call(hv, hvc.RebootVirtualMachine, vmRequest[hypervisorv1.RebootVirtualMachineRequest])},
	{"delete_vm", hintDestructive, "WRITES (destructive): delete a VM: stop it, then remove its disk, vTPM, lease, port forwards and record. Not undoable. Returns {id, deleted}.",
		run((*tools).deleteVM)},
	{"exec_vm", hintExec, "WRITES (destructive): run a command in the guest as root, over ssh through the virtual network with the per-VM key; the guest's host key is pinned on first use. Returns {stdout, stderr, exitCode}; a non-zero exit is a result, not an error.",
		call(hv, hvc.ExecVirtualMachine, func(in *execArgs) *hypervisorv1.ExecVirtualMachineRequest {
			return &hypervisorv1.ExecVirtualMachineRequest{Id: in.ID, Command: in.Command}
		})},
	{"forward_port", hintIdempotent, "WRITES: expose a guest TCP port (for example 6443, the Kubernetes API) on a host loopback address 127.0.0.1:<port>. Returns {id, port, address}; the forward lives until the VM is deleted.",
		call(hv, hvc.ForwardVirtualMachinePort, func(in *forwardArgs) *hypervisorv1.ForwardVirtualMachinePortRequest {
			return &hypervisorv1.ForwardVirtualMachinePortRequest{Id: in.ID, Port: in.Port}
		})},
	// Lifetimes (lifetime.go).
	{"update_vm_lifetime", hintLifetime, "WRITES (destructive): extend, shorten or clear a VM's expiry (ttl from now, expire_at, or clear_expiry), change on_expire (stop or delete: the VM ends then), or its idle auto-stop (idle_timeout, \"0s\" for none). Arguments left out keep their values. Returns the VM; its lifetime shows expireAt, onExpire, idleTimeout and lastActivityAt.",
		run((*tools).updateLifetime)},
	// Suspend (issue 19): idempotent like stop_vm, not destructive: the
	// processes end but the whole VM, RAM included, is kept on disk.
	{"suspend_vm", hintIdempotent, "WRITES: suspend a ready or running VM: its RAM, devices and vTPM are saved into its directory and its processes end (state suspended; no CPU or RAM used). resume_vm continues it where it was. A suspend that fails leaves the VM running. Conflict in any other state.",
		call(hv, hvc.SuspendVirtualMachine, vmRequest[hypervisorv1.SuspendVirtualMachineRequest])},
	{"resume_vm", hintIdempotent, "WRITES: resume a suspended VM from its saved state: the same boot carries on (attestation, user data, vTPM keys, forwards), the guest clock is set again. A resume that fails keeps the state and the VM stays suspended with lastError. stop_vm on a suspended VM discards the state.",
		call(hv, hvc.ResumeVirtualMachine, vmRequest[hypervisorv1.ResumeVirtualMachineRequest])},
	// OCI image import (issue 27, imports.go): a server stream, answered
	// once it is done, its progress as notifications.
	{"import_image", hintImport, importImageDescription,
		register((*tools).importImage, importOutput())},
	// Warm pools (pools.go).
	{"list_pools", hintRead, listPoolsDescription,
		list(hv, hvc.ListPools, func(in *listPoolsArgs) *hypervisorv1.ListPoolsRequest {
			return &hypervisorv1.ListPoolsRequest{Node: in.Node}
		}, (*hypervisorv1.ListPoolsResponse).GetPools)},
	{"get_pool", hintRead, getPoolDescription,
		call(hv, hvc.GetPool, func(in *poolArgs) *hypervisorv1.GetPoolRequest { return &hypervisorv1.GetPoolRequest{Name: in.Name} })},
	{"create_pool", hintCreate, createPoolDescription,
		call(hv, hvc.CreatePool, func(in *createPoolArgs) *hypervisorv1.CreatePoolRequest {
			return &hypervisorv1.CreatePoolRequest{
				Name: in.Name, Size: in.Size, Image: in.Image, KubernetesVersion: in.KubernetesVersion,
				Cpus: in.CPUs, MemoryMib: in.MemoryMiB, DiskGib: in.DiskGiB, Network: in.Network,
				RequireAttestation: in.RequireAttestation, Node: in.Node,
			}
		})},
	// Idempotent, not destructive: a repeat answers the same pool, and the
	// members a shrink deletes were never anyone's (growing makes them
	// again), as suspend_vm's class says of what can be undone.
	{"resize_pool", hintIdempotent, resizePoolDescription,
		call(hv, hvc.ResizePool, func(in *resizePoolArgs) *hypervisorv1.ResizePoolRequest {
			return &hypervisorv1.ResizePoolRequest{Name: in.Name, Size: in.Size}
		})},
	{"delete_pool", hintDestructive, deletePoolDescription,
		call(hv, hvc.DeletePool, func(in *poolArgs) *hypervisorv1.DeletePoolRequest {
			return &hypervisorv1.DeletePoolRequest{Name: in.Name}
		})},
	// Forks (fork.go): create_vm's class, as each call makes new VMs.
	{"fork_vm", hintCreate, forkVMDescription, call(hv, hvc.ForkVirtualMachine, forkRequest)},
}

// none is the request of a call that takes no arguments.
func none[Req any](*noArgs) *Req { return new(Req) }

// vmRequest is the request of a call on one VM: a Req with its id field
// set to the argument.
func vmRequest[Req any, P interface {
	*Req
	proto.Message
}](in *vmArgs) P {
	req := P(new(Req))
	m := req.ProtoReflect()
	fd := m.Descriptor().Fields().ByName("id")
	if fd == nil || fd.Kind() != protoreflect.StringKind {
		panic(fmt.Sprintf("mcp: %s has no string field id", m.Descriptor().FullName()))
	}
	m.Set(fd, protoreflect.ValueOfString(in.ID))
	return req
}

// call is a tool that is one call of a client's method, with the request
// req builds from the arguments; its result is the response.
func call[C, In, Req any, Resp proto.Message](client func(*tools) C, method func(C, context.Context, Req, ...grpc.CallOption) (Resp, error), req func(*In) Req) addFunc {
	return run(func(t *tools, ctx context.Context, _ *mcp.CallToolRequest, in *In) (Resp, error) {
		return method(client(t), ctx, req(in))
	})
}

// list is call for a List method: the result is the list in the response,
// [] rather than null when it is empty.
func list[C, In, Req any, Resp proto.Message, Item any](client func(*tools) C, method func(C, context.Context, Req, ...grpc.CallOption) (Resp, error), req func(*In) Req, items func(Resp) []Item) addFunc {
	return func(s *mcp.Server, t *tools, d toolDef) {
		var zero Resp
		out, err := listOutput(zero.ProtoReflect().Descriptor())
		if err != nil {
			panic(fmt.Sprintf("mcp: tool %s: %v", d.name, err))
		}
		register(func(t *tools, ctx context.Context, _ *mcp.CallToolRequest, in *In) (listed, error) {
			resp, err := method(client(t), ctx, req(in))
			if err != nil {
				return listed{}, err
			}
			var warnings []string
			if w, ok := any(resp).(interface{ GetWarnings() []string }); ok {
				warnings = w.GetWarnings()
			}
			return listed{items: nonNil(items(resp)), warnings: warnings}, nil
		}, out)(s, t, d)
	}
}

// deleted is what the delete tools answer, as the original: the id of what
// was deleted (a network's is its name).
type deleted struct {
	ID      string `json:"id"`
	Deleted bool   `json:"deleted"`
}

func (t *tools) deleteNetwork(ctx context.Context, _ *mcp.CallToolRequest, in *networkArgs) (deleted, error) {
	if _, err := t.hv.DeleteNetwork(ctx, &hypervisorv1.DeleteNetworkRequest{Name: in.Name}); err != nil {
		return deleted{}, err
	}
	return deleted{ID: in.Name, Deleted: true}, nil
}

func (t *tools) deleteVM(ctx context.Context, _ *mcp.CallToolRequest, in *vmArgs) (deleted, error) {
	if _, err := t.hv.DeleteVirtualMachine(ctx, &hypervisorv1.DeleteVirtualMachineRequest{Id: in.ID}); err != nil {
		return deleted{}, err
	}
	return deleted{ID: in.ID, Deleted: true}, nil
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
func (t *tools) createVM(ctx context.Context, req *mcp.CallToolRequest, in *createVMArgs) (*hypervisorv1.VirtualMachine, error) {
	wf, ok := waitFor[in.WaitFor]
	if !ok { // the schema's enum catches this first
		return nil, apierr.Invalidf("wait_for", "wait_for: %q is not one of none, installed, attested, ready", in.WaitFor)
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
		Node:               in.Node,
		NodeSelector:       in.NodeSelector,
		SkipPool:           in.SkipPool,
	}
	if err := in.lifetimeArgs.apply(creq); err != nil {
		return nil, err
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
