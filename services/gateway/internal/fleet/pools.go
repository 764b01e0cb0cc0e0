package fleet

import (
	"context"
	"slices"
	"strings"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/protobuf/proto"
)

// Warm pools are per node: a pool's members are suspended VMs on one host,
// and only a create on that host can claim them. The fleet keeps a pool's
// name unique (CreatePool checks), so the calls naming a pool find its node
// by asking every node.

// CreatePool creates on the named node, or on the only node of a one-node
// fleet: a pool holds a host's CPUs, memory and disk while nobody uses
// them, so the fleet does not place one by itself. A name another node
// already has is a conflict.
func (h *Hypervisor) CreatePool(ctx context.Context, req *hypervisorv1.CreatePoolRequest) (*hypervisorv1.Pool, error) {
	name := req.GetNode()
	if name == "" {
		ns, _ := h.r.nodes()
		switch len(ns) {
		case 0:
			return nil, apierr.Errorf(apierr.Unavailable, "no fleet nodes known")
		case 1:
			name = ns[0].Name
		default:
			return nil, apierr.Invalidf("node", "node: required in a fleet of %d nodes: the node to keep the pool on (GetHost without node lists them)", len(ns))
		}
	}
	target, err := h.r.named(name)
	if err != nil {
		return nil, err
	}
	found, _ := h.findPool(ctx, req.GetName())
	if nodes := nodeNames(found); len(nodes) > 0 && !slices.Equal(nodes, []string{target.Name}) {
		return nil, apierr.Errorf(apierr.Conflict, "pool %q already exists on fleet node %s: pool names are unique in a fleet",
			req.GetName(), strings.Join(nodes, ", "))
	}
	fwd := proto.CloneOf(req)
	fwd.Node = "" // the node never sees the fleet's field
	p, err := target.hv.CreatePool(ctx, fwd)
	if err != nil {
		return nil, nodeErr(ctx, target, err)
	}
	p.Node = target.Name
	return p, nil
}

// ListPools merges the nodes' pools (or the named node's), each with its
// node, sorted by name; a node that did not answer is a warning.
func (h *Hypervisor) ListPools(ctx context.Context, req *hypervisorv1.ListPoolsRequest) (*hypervisorv1.ListPoolsResponse, error) {
	out := &hypervisorv1.ListPoolsResponse{}
	out.Pools = mergeLists(ctx, h.r, req.GetNode(), &out.Warnings, func(ctx context.Context, n *node) ([]*hypervisorv1.Pool, error) {
		resp, err := n.hv.ListPools(ctx, &hypervisorv1.ListPoolsRequest{})
		return resp.GetPools(), err
	}, func(p *hypervisorv1.Pool, node string) { p.Node = node })
	// Stable: within a name (only after a create the fleet could not
	// check), by node index.
	slices.SortStableFunc(out.Pools, func(a, b *hypervisorv1.Pool) int { return strings.Compare(a.GetName(), b.GetName()) })
	return out, nil
}

// GetPool is the pool on the node that has it.
func (h *Hypervisor) GetPool(ctx context.Context, req *hypervisorv1.GetPoolRequest) (*hypervisorv1.Pool, error) {
	x, err := h.poolNode(ctx, req.GetName())
	if err != nil {
		return nil, err
	}
	x.val.Node = x.node.Name
	return x.val, nil
}

// ResizePool resizes on the node that has the pool.
func (h *Hypervisor) ResizePool(ctx context.Context, req *hypervisorv1.ResizePoolRequest) (*hypervisorv1.Pool, error) {
	x, err := h.poolNode(ctx, req.GetName())
	if err != nil {
		return nil, err
	}
	p, err := x.node.hv.ResizePool(ctx, req)
	if err != nil {
		return nil, nodeErr(ctx, x.node, err)
	}
	p.Node = x.node.Name
	return p, nil
}

// DeletePool deletes on the node that has the pool.
func (h *Hypervisor) DeletePool(ctx context.Context, req *hypervisorv1.DeletePoolRequest) (*hypervisorv1.DeletePoolResponse, error) {
	x, err := h.poolNode(ctx, req.GetName())
	if err != nil {
		return nil, err
	}
	resp, err := x.node.hv.DeletePool(ctx, req)
	return resp, nodeErr(ctx, x.node, err)
}

// findPool asks every node for the pool: the nodes that have it, in index
// order, and a line per node that answered neither the pool nor not_found.
func (h *Hypervisor) findPool(ctx context.Context, name string) (found []result[*hypervisorv1.Pool], failed []result[*hypervisorv1.Pool]) {
	for _, x := range fanOut(ctx, h.r, func(ctx context.Context, n *node) (*hypervisorv1.Pool, error) {
		return n.hv.GetPool(ctx, &hypervisorv1.GetPoolRequest{Name: name})
	}) {
		switch {
		case x.err == nil:
			found = append(found, x)
		case apierr.CodeOf(x.err) != apierr.NotFound:
			failed = append(failed, x)
		}
	}
	return found, failed
}

// poolNode is the one node that has the pool: not_found when no node has
// it, conflict when several do, and, when none has it but some did not
// answer, the first of those nodes' errors naming them (the pool may be on
// one of them).
func (h *Hypervisor) poolNode(ctx context.Context, name string) (result[*hypervisorv1.Pool], error) {
	found, failed := h.findPool(ctx, name)
	switch {
	case len(found) == 1:
		return found[0], nil
	case len(found) > 1:
		return result[*hypervisorv1.Pool]{}, apierr.Errorf(apierr.Conflict,
			"pool %q is on several fleet nodes (%s): delete all but one through those nodes' own gateways",
			name, strings.Join(nodeNames(found), ", "))
	case len(failed) > 0:
		lines := make([]string, len(failed))
		for i, x := range failed {
			lines[i] = warning(x.node, x.err)
		}
		return result[*hypervisorv1.Pool]{}, apierr.Errorf(apierr.CodeOf(failed[0].err),
			"pool %q is on no fleet node that answered: %s", name, strings.Join(lines, "; "))
	}
	if ns, _ := h.r.nodes(); len(ns) == 0 {
		return result[*hypervisorv1.Pool]{}, apierr.Errorf(apierr.Unavailable, "no fleet nodes known")
	}
	return result[*hypervisorv1.Pool]{}, apierr.Errorf(apierr.NotFound, "pool %q not found on any fleet node", name)
}

// nodeNames are the names of the answers' nodes.
func nodeNames[T any](res []result[T]) []string {
	out := make([]string, len(res))
	for i, x := range res {
		out[i] = x.node.Name
	}
	return out
}
