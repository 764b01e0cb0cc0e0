package fleet

import (
	"context"
	"fmt"
	"strings"

	"github.com/giantswarm/vm-manager/gen/apierr"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/labels"
	"google.golang.org/protobuf/proto"
)

// The create request's defaults (contract: cpus 2, memory_mib 2048), which
// placement counts when a create leaves them out.
const (
	defaultCPUs      = 2
	defaultMemoryMiB = 2048
)

// everywhere runs f on the named node, or on every node; the answer is the
// first node's (by index), or, when some failed, an error naming them (what
// succeeded elsewhere is kept: the caller retries, and the nodes that have
// it answer conflict). A nil answer with no error means "nothing to do here".
func everywhere[T comparable](ctx context.Context, r *Router, name string, f func(context.Context, *node) (T, error)) (T, error) {
	var zero T
	if name != "" {
		n, err := r.named(name)
		if err != nil {
			return zero, err
		}
		v, err := f(ctx, n)
		return v, nodeErr(ctx, n, err)
	}
	res := fanOut(ctx, r, f)
	if len(res) == 0 {
		return zero, apierr.Errorf(apierr.Unavailable, "no fleet nodes known")
	}
	var first T
	var failed []string
	var firstErr error
	for _, x := range res {
		if x.err != nil {
			failed = append(failed, fmt.Sprintf("%s: %s", x.node.Name, apierr.MessageOf(x.err)))
			if firstErr == nil {
				firstErr = x.err
			}
			continue
		}
		if first == zero {
			first = x.val
		}
	}
	if firstErr != nil {
		return zero, apierr.Errorf(apierr.CodeOf(firstErr), "failed on %d of %d fleet nodes (the others succeeded): %s",
			len(failed), len(res), strings.Join(failed, "; "))
	}
	return first, nil
}

// capacity is a node's host report with what its VMs take.
type capacity struct {
	host             *hypervisorv1.Host
	vms              int32
	allocCPUs        int32
	allocMemoryBytes int64
	freeCPUs         int32
	freeMemoryBytes  int64
}

// holdsResources is whether a VM in this state has its cpus and memory
// (a stopped, failed or suspended VM has no QEMU running).
func holdsResources(s hypervisorv1.State) bool {
	switch s {
	case hypervisorv1.State_STATE_STOPPED, hypervisorv1.State_STATE_FAILED, hypervisorv1.State_STATE_SUSPENDED:
		return false
	}
	return true
}

// capacityOf asks a node for its host report and VMs.
func capacityOf(ctx context.Context, n *node) (capacity, error) {
	h, err := n.hv.GetHost(ctx, &hypervisorv1.GetHostRequest{})
	if err != nil {
		return capacity{}, err
	}
	vms, err := n.hv.ListVirtualMachines(ctx, &hypervisorv1.ListVirtualMachinesRequest{})
	if err != nil {
		return capacity{}, err
	}
	c := capacity{host: h, vms: int32(len(vms.GetVms()))}
	for _, vm := range vms.GetVms() {
		if holdsResources(vm.GetState()) {
			c.allocCPUs += vm.GetCpus()
			c.allocMemoryBytes += int64(vm.GetMemoryMib()) << 20
		}
	}
	c.freeCPUs = h.GetCpus() - c.allocCPUs
	c.freeMemoryBytes = h.GetMemoryBytes() - c.allocMemoryBytes
	return c, nil
}

// nodeLabels are a node's labels for placement: the host report's, with
// the zone discovery found (topology.kubernetes.io/zone) when it has none.
func nodeLabels(n *node, h *hypervisorv1.Host) map[string]string {
	l := map[string]string{}
	for k, v := range h.GetNodeLabels() {
		l[k] = v
	}
	if _, ok := l["topology.kubernetes.io/zone"]; !ok && n.Zone != "" {
		l["topology.kubernetes.io/zone"] = n.Zone
	}
	return l
}

// place picks the node for a create: the named one, or the ready node whose
// labels match the selector with the most free memory (then cpus, then the
// lowest index) that can hold the VM. Nodes that do not answer are skipped.
func (h *Hypervisor) place(ctx context.Context, req *hypervisorv1.CreateVirtualMachineRequest) (*node, error) {
	if req.GetNode() != "" {
		return h.r.named(req.GetNode())
	}
	sel, err := labels.Parse(req.GetNodeSelector())
	if err != nil {
		return nil, apierr.Invalidf("node_selector", "%v", err)
	}
	wantCPUs := int32(defaultCPUs)
	if req.Cpus != nil {
		wantCPUs = req.GetCpus()
	}
	wantMem := int64(defaultMemoryMiB) << 20
	if req.MemoryMib != nil {
		wantMem = int64(req.GetMemoryMib()) << 20
	}
	var best *node
	var bestCap capacity
	var reasons []string
	for _, x := range fanOut(ctx, h.r, capacityOf) {
		switch {
		case x.err != nil:
			reasons = append(reasons, warning(x.node, x.err))
		case !labels.Match(sel, nodeLabels(x.node, x.val.host)):
			reasons = append(reasons, fmt.Sprintf("node %s: labels do not match", x.node.Name))
		case !x.val.host.GetReady():
			reasons = append(reasons, fmt.Sprintf("node %s: host not ready (%s)", x.node.Name, strings.Join(x.val.host.GetMissing(), ", ")))
		case x.val.freeCPUs < wantCPUs || x.val.freeMemoryBytes < wantMem:
			reasons = append(reasons, fmt.Sprintf("node %s: %d cpus and %d MiB free", x.node.Name, x.val.freeCPUs, x.val.freeMemoryBytes>>20))
		case best == nil || x.val.freeMemoryBytes > bestCap.freeMemoryBytes ||
			(x.val.freeMemoryBytes == bestCap.freeMemoryBytes && x.val.freeCPUs > bestCap.freeCPUs):
			best, bestCap = x.node, x.val
		}
	}
	if best == nil {
		return nil, apierr.Errorf(apierr.ResourceExhausted, "no fleet node can hold %d cpus and %d MiB (node_selector %q): %s",
			wantCPUs, wantMem>>20, req.GetNodeSelector(), strings.Join(reasons, "; "))
	}
	return best, nil
}

// CreateVirtualMachine creates on the node placement picks; the node never
// sees the fleet's fields.
func (h *Hypervisor) CreateVirtualMachine(ctx context.Context, req *hypervisorv1.CreateVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	n, err := h.place(ctx, req)
	if err != nil {
		return nil, err
	}
	fwd := cloneCreate(req)
	vm, err := n.hv.CreateVirtualMachine(ctx, fwd)
	if err != nil {
		return nil, nodeErr(ctx, n, err)
	}
	vm.Node = n.Name
	return vm, nil
}

func cloneCreate(req *hypervisorv1.CreateVirtualMachineRequest) *hypervisorv1.CreateVirtualMachineRequest {
	c := proto.Clone(req).(*hypervisorv1.CreateVirtualMachineRequest)
	c.Node, c.NodeSelector = "", ""
	return c
}

// GetHost is the named node's report, or the fleet summary: totals over
// the nodes that answered, a line per node, a warning per node that did not.
func (h *Hypervisor) GetHost(ctx context.Context, req *hypervisorv1.GetHostRequest) (*hypervisorv1.Host, error) {
	if req.GetNode() != "" {
		n, err := h.r.named(req.GetNode())
		if err != nil {
			return nil, err
		}
		host, err := n.hv.GetHost(ctx, &hypervisorv1.GetHostRequest{})
		return host, nodeErr(ctx, n, err)
	}
	sum := &hypervisorv1.Host{Hostname: "fleet"}
	for _, x := range fanOut(ctx, h.r, capacityOf) {
		line := &hypervisorv1.FleetNode{Name: x.node.Name, Index: int32(x.node.Index)}
		sum.FleetNodes = append(sum.FleetNodes, line)
		if x.err != nil {
			line.Error = apierr.MessageOf(x.err)
			sum.Warnings = append(sum.Warnings, warning(x.node, x.err))
			continue
		}
		c := x.val
		line.Available, line.Ready, line.Hostname = true, c.host.GetReady(), c.host.GetHostname()
		line.Cpus, line.MemoryBytes, line.Labels = c.host.GetCpus(), c.host.GetMemoryBytes(), nodeLabels(x.node, c.host)
		line.Vms, line.AllocatedCpus, line.AllocatedMemoryBytes = c.vms, c.allocCPUs, c.allocMemoryBytes
		sum.Cpus += line.Cpus
		sum.MemoryBytes += line.MemoryBytes
		sum.Ready = sum.Ready || line.Ready
	}
	if !sum.Ready {
		sum.Missing = append(sum.Missing, "a ready fleet node")
	}
	return sum, nil
}
