package fleet

import (
	"context"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
)

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

// GetHost is the named node's report, or the fleet summary: totals over
// the nodes that answered, a line per node, a warning per node that did not.
func (h *Hypervisor) GetHost(ctx context.Context, req *hypervisorv1.GetHostRequest) (*hypervisorv1.Host, error) {
	if req.GetNode() != "" {
		return onNamed(ctx, h.r, req.GetNode(), func(ctx context.Context, n *node) (*hypervisorv1.Host, error) {
			return n.hv.GetHost(ctx, &hypervisorv1.GetHostRequest{})
		})
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
