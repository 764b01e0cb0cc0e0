package fleet

import (
	"context"
	"slices"
	"strings"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// Hypervisor is HypervisorService at fleet level: a call naming a VM goes
// to the node its id names, lists fan out and merge, a create is placed.
type Hypervisor struct {
	// Unsafe, not Unimplemented: an RPC the fleet does not route is a
	// compile error here, not an Unimplemented answer in fleet mode only.
	hypervisorv1.UnsafeHypervisorServiceServer
	r *Router
}

// NewHypervisor returns the fleet's HypervisorService over r.
func NewHypervisor(r *Router) *Hypervisor { return &Hypervisor{r: r} }

// onVM calls f on the VM's node and stamps the node's name on the VM it
// returns.
func onVM[T any](ctx context.Context, r *Router, id string, f func(context.Context, *node) (T, error)) (T, error) {
	var zero T
	n, err := r.forVM(id)
	if err != nil {
		return zero, err
	}
	v, err := f(ctx, n)
	if err != nil {
		return zero, nodeErr(ctx, n, err)
	}
	if vm, ok := any(v).(*hypervisorv1.VirtualMachine); ok {
		vm.Node = n.Name
	}
	return v, nil
}

func (h *Hypervisor) GetVirtualMachine(ctx context.Context, req *hypervisorv1.GetVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return onVM(ctx, h.r, req.GetId(), func(ctx context.Context, n *node) (*hypervisorv1.VirtualMachine, error) {
		return n.hv.GetVirtualMachine(ctx, req)
	})
}

func (h *Hypervisor) DeleteVirtualMachine(ctx context.Context, req *hypervisorv1.DeleteVirtualMachineRequest) (*hypervisorv1.DeleteVirtualMachineResponse, error) {
	return onVM(ctx, h.r, req.GetId(), func(ctx context.Context, n *node) (*hypervisorv1.DeleteVirtualMachineResponse, error) {
		return n.hv.DeleteVirtualMachine(ctx, req)
	})
}

func (h *Hypervisor) StartVirtualMachine(ctx context.Context, req *hypervisorv1.StartVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return onVM(ctx, h.r, req.GetId(), func(ctx context.Context, n *node) (*hypervisorv1.VirtualMachine, error) {
		return n.hv.StartVirtualMachine(ctx, req)
	})
}

func (h *Hypervisor) StopVirtualMachine(ctx context.Context, req *hypervisorv1.StopVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return onVM(ctx, h.r, req.GetId(), func(ctx context.Context, n *node) (*hypervisorv1.VirtualMachine, error) {
		return n.hv.StopVirtualMachine(ctx, req)
	})
}

func (h *Hypervisor) RebootVirtualMachine(ctx context.Context, req *hypervisorv1.RebootVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return onVM(ctx, h.r, req.GetId(), func(ctx context.Context, n *node) (*hypervisorv1.VirtualMachine, error) {
		return n.hv.RebootVirtualMachine(ctx, req)
	})
}

func (h *Hypervisor) SuspendVirtualMachine(ctx context.Context, req *hypervisorv1.SuspendVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return onVM(ctx, h.r, req.GetId(), func(ctx context.Context, n *node) (*hypervisorv1.VirtualMachine, error) {
		return n.hv.SuspendVirtualMachine(ctx, req)
	})
}

func (h *Hypervisor) ResumeVirtualMachine(ctx context.Context, req *hypervisorv1.ResumeVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return onVM(ctx, h.r, req.GetId(), func(ctx context.Context, n *node) (*hypervisorv1.VirtualMachine, error) {
		return n.hv.ResumeVirtualMachine(ctx, req)
	})
}

// ForkVirtualMachine forks on the parent's node: a fork is made from the
// parent's memory on its host, so it stays there (its id carries that
// node's index, which routes later calls to it).
func (h *Hypervisor) ForkVirtualMachine(ctx context.Context, req *hypervisorv1.ForkVirtualMachineRequest) (*hypervisorv1.ForkVirtualMachineResponse, error) {
	return onVM(ctx, h.r, req.GetId(), func(ctx context.Context, n *node) (*hypervisorv1.ForkVirtualMachineResponse, error) {
		resp, err := n.hv.ForkVirtualMachine(ctx, req)
		for _, vm := range resp.GetVms() {
			vm.Node = n.Name
		}
		return resp, err
	})
}

func (h *Hypervisor) ExecVirtualMachine(ctx context.Context, req *hypervisorv1.ExecVirtualMachineRequest) (*hypervisorv1.ExecVirtualMachineResponse, error) {
	return onVM(ctx, h.r, req.GetId(), func(ctx context.Context, n *node) (*hypervisorv1.ExecVirtualMachineResponse, error) {
		return n.hv.ExecVirtualMachine(ctx, req)
	})
}

// ForwardVirtualMachinePort forwards on the VM's node: the address it
// answers is that node's loopback, reachable from the node only.
func (h *Hypervisor) ForwardVirtualMachinePort(ctx context.Context, req *hypervisorv1.ForwardVirtualMachinePortRequest) (*hypervisorv1.ForwardVirtualMachinePortResponse, error) {
	return onVM(ctx, h.r, req.GetId(), func(ctx context.Context, n *node) (*hypervisorv1.ForwardVirtualMachinePortResponse, error) {
		return n.hv.ForwardVirtualMachinePort(ctx, req)
	})
}

func (h *Hypervisor) GetVirtualMachineConsole(ctx context.Context, req *hypervisorv1.GetVirtualMachineConsoleRequest) (*hypervisorv1.GetVirtualMachineConsoleResponse, error) {
	return onVM(ctx, h.r, req.GetId(), func(ctx context.Context, n *node) (*hypervisorv1.GetVirtualMachineConsoleResponse, error) {
		return n.hv.GetVirtualMachineConsole(ctx, req)
	})
}

func (h *Hypervisor) GetVirtualMachineMetrics(ctx context.Context, req *hypervisorv1.GetVirtualMachineMetricsRequest) (*hypervisorv1.VirtualMachineMetrics, error) {
	return onVM(ctx, h.r, req.GetId(), func(ctx context.Context, n *node) (*hypervisorv1.VirtualMachineMetrics, error) {
		return n.hv.GetVirtualMachineMetrics(ctx, req)
	})
}

func (h *Hypervisor) GetVirtualMachineReport(ctx context.Context, req *hypervisorv1.GetVirtualMachineReportRequest) (*hypervisorv1.GetVirtualMachineReportResponse, error) {
	return onVM(ctx, h.r, req.GetId(), func(ctx context.Context, n *node) (*hypervisorv1.GetVirtualMachineReportResponse, error) {
		return n.hv.GetVirtualMachineReport(ctx, req)
	})
}

func (h *Hypervisor) UpdateVirtualMachineLifetime(ctx context.Context, req *hypervisorv1.UpdateVirtualMachineLifetimeRequest) (*hypervisorv1.VirtualMachine, error) {
	return onVM(ctx, h.r, req.GetId(), func(ctx context.Context, n *node) (*hypervisorv1.VirtualMachine, error) {
		return n.hv.UpdateVirtualMachineLifetime(ctx, req)
	})
}

// ListVirtualMachines merges every node's VMs, oldest first (the
// contract's order), each with its node; a node that does not answer is a
// warning naming it.
func (h *Hypervisor) ListVirtualMachines(ctx context.Context, req *hypervisorv1.ListVirtualMachinesRequest) (*hypervisorv1.ListVirtualMachinesResponse, error) {
	if req.GetNode() != "" {
		return onNamed(ctx, h.r, req.GetNode(), func(ctx context.Context, n *node) (*hypervisorv1.ListVirtualMachinesResponse, error) {
			resp, err := n.hv.ListVirtualMachines(ctx, &hypervisorv1.ListVirtualMachinesRequest{})
			if err != nil {
				return nil, err
			}
			for _, vm := range resp.GetVms() {
				vm.Node = n.Name
			}
			return resp, nil
		})
	}
	out := &hypervisorv1.ListVirtualMachinesResponse{}
	for _, x := range fanOut(ctx, h.r, func(ctx context.Context, n *node) (*hypervisorv1.ListVirtualMachinesResponse, error) {
		return n.hv.ListVirtualMachines(ctx, req)
	}) {
		if x.err != nil {
			out.Warnings = append(out.Warnings, warning(x.node, x.err))
			continue
		}
		for _, vm := range x.val.GetVms() {
			vm.Node = x.node.Name
			out.Vms = append(out.Vms, vm)
		}
	}
	slices.SortStableFunc(out.Vms, func(a, b *hypervisorv1.VirtualMachine) int {
		if c := a.GetCreatedAt().AsTime().Compare(b.GetCreatedAt().AsTime()); c != 0 {
			return c
		}
		return strings.Compare(a.GetId(), b.GetId())
	})
	return out, nil
}

// ListImages merges the nodes' catalogs (images are per node: each names
// its node), sorted by id, newest version first, then by node.
func (h *Hypervisor) ListImages(ctx context.Context, req *hypervisorv1.ListImagesRequest) (*hypervisorv1.ListImagesResponse, error) {
	out := &hypervisorv1.ListImagesResponse{}
	out.Images = mergeLists(ctx, h.r, req.GetNode(), &out.Warnings, func(ctx context.Context, n *node) ([]*hypervisorv1.Image, error) {
		resp, err := n.hv.ListImages(ctx, &hypervisorv1.ListImagesRequest{})
		return resp.GetImages(), err
	}, func(img *hypervisorv1.Image, node string) { img.Node = node })
	// Each node's list is already in the contract's order; keep it within
	// an id and merge by id.
	slices.SortStableFunc(out.Images, func(a, b *hypervisorv1.Image) int { return strings.Compare(a.GetId(), b.GetId()) })
	return out, nil
}

// ListNetworks merges the nodes' networks (per node: each names its node),
// sorted by name, then node.
func (h *Hypervisor) ListNetworks(ctx context.Context, req *hypervisorv1.ListNetworksRequest) (*hypervisorv1.ListNetworksResponse, error) {
	out := &hypervisorv1.ListNetworksResponse{}
	out.Networks = mergeLists(ctx, h.r, req.GetNode(), &out.Warnings, func(ctx context.Context, n *node) ([]*hypervisorv1.Network, error) {
		resp, err := n.hv.ListNetworks(ctx, &hypervisorv1.ListNetworksRequest{})
		return resp.GetNetworks(), err
	}, func(net *hypervisorv1.Network, node string) { net.Node = node })
	slices.SortStableFunc(out.Networks, func(a, b *hypervisorv1.Network) int {
		return strings.Compare(a.GetSpec().GetName(), b.GetSpec().GetName())
	})
	return out, nil
}

// mergeLists runs list on the named node, or on every node, and joins the
// lists that came, in index order, each item stamped with its node by
// setNode; a node that did not answer is a warning.
func mergeLists[T any](ctx context.Context, r *Router, name string, warnings *[]string, list func(context.Context, *node) ([]T, error), setNode func(T, string)) []T {
	var out []T
	for _, x := range perNode(ctx, r, name, list, warnings) {
		for _, v := range x.val {
			setNode(v, x.node.Name)
			out = append(out, v)
		}
	}
	return out
}

// perNode runs f on the named node, or on every node; the answers that
// came, in index order, with a warning per node that did not.
func perNode[T any](ctx context.Context, r *Router, name string, f func(context.Context, *node) (T, error), warnings *[]string) []result[T] {
	if name != "" {
		n, err := r.named(name)
		if err == nil {
			var v T
			v, err = f(ctx, n)
			if err == nil {
				return []result[T]{{node: n, val: v}}
			}
			err = nodeErr(ctx, n, err)
		}
		*warnings = append(*warnings, apierr.MessageOf(err))
		return nil
	}
	var out []result[T]
	for _, x := range fanOut(ctx, r, f) {
		if x.err != nil {
			*warnings = append(*warnings, warning(x.node, x.err))
			continue
		}
		out = append(out, x)
	}
	return out
}

// GetImage is the image on the named node, or on the first node (by index)
// whose catalog has it. Its call, like GetNetwork's and CreateNetwork's,
// stamps the node on the message it answers: kept one per RPC, as each calls
// its own method and the generated messages have no setter for Node to write
// the stamp once (the routing is firstFound's and everywhere's).
func (h *Hypervisor) GetImage(ctx context.Context, req *hypervisorv1.GetImageRequest) (*hypervisorv1.Image, error) {
	return firstFound(ctx, h.r, req.GetNode(), func(ctx context.Context, n *node) (*hypervisorv1.Image, error) {
		img, err := n.hv.GetImage(ctx, req)
		if err == nil {
			img.Node = n.Name
		}
		return img, err
	})
}

// GetNetwork is the network on the named node, or on the first node (by
// index) that has it.
func (h *Hypervisor) GetNetwork(ctx context.Context, req *hypervisorv1.GetNetworkRequest) (*hypervisorv1.Network, error) {
	return firstFound(ctx, h.r, req.GetNode(), func(ctx context.Context, n *node) (*hypervisorv1.Network, error) {
		net, err := n.hv.GetNetwork(ctx, req)
		if err == nil {
			net.Node = n.Name
		}
		return net, err
	})
}

// firstFound asks the named node, or every node, and answers the first (by
// index) that has it; not_found when none has, unavailable when none has
// but some did not answer.
func firstFound[T any](ctx context.Context, r *Router, name string, f func(context.Context, *node) (T, error)) (T, error) {
	var zero T
	if name != "" {
		return onNamed(ctx, r, name, f)
	}
	var notFound, other error
	for _, x := range fanOut(ctx, r, f) {
		switch {
		case x.err == nil:
			return x.val, nil
		case apierr.CodeOf(x.err) == apierr.NotFound:
			notFound = x.err
		case other == nil:
			other = x.err
		}
	}
	if other != nil {
		return zero, other
	}
	if notFound != nil {
		return zero, notFound
	}
	return zero, apierr.Errorf(apierr.Unavailable, "no fleet nodes known")
}

// CreateNetwork creates on the named node, or on every node (a network is a
// bridge on each host; one created fleet-wide lets a VM be placed anywhere).
// A fleet-wide create that fails on some nodes keeps what it made and
// answers the first failure naming the nodes.
func (h *Hypervisor) CreateNetwork(ctx context.Context, req *hypervisorv1.CreateNetworkRequest) (*hypervisorv1.Network, error) {
	return everywhere(ctx, h.r, req.GetNode(), func(ctx context.Context, n *node) (*hypervisorv1.Network, error) {
		net, err := n.hv.CreateNetwork(ctx, req)
		if err == nil {
			net.Node = n.Name
		}
		return net, err
	})
}

// DeleteNetwork deletes on the named node, or on every node that has it.
func (h *Hypervisor) DeleteNetwork(ctx context.Context, req *hypervisorv1.DeleteNetworkRequest) (*hypervisorv1.DeleteNetworkResponse, error) {
	resp, err := everywhere(ctx, h.r, req.GetNode(), func(ctx context.Context, n *node) (*hypervisorv1.DeleteNetworkResponse, error) {
		resp, err := n.hv.DeleteNetwork(ctx, req)
		if apierr.CodeOf(err) == apierr.NotFound && req.GetNode() == "" {
			// Fleet-wide: a node without it has nothing to delete.
			return nil, nil
		}
		return resp, err
	})
	if err == nil && resp == nil {
		return nil, apierr.Errorf(apierr.NotFound, "network %q not found on any fleet node", req.GetName())
	}
	return resp, err
}
