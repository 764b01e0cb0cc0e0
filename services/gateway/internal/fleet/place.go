package fleet

import (
	"context"
	"fmt"
	"strings"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/labels"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/protobuf/proto"
)

// The create request's defaults (contract: cpus 2, memory_mib 2048), which
// placement counts when a create leaves them out.
const (
	defaultCPUs      = 2
	defaultMemoryMiB = 2048
)

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
