package fleet

import (
	"context"
	"fmt"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
)

// watchRetry is how soon a node's ended watch stream is opened again.
const watchRetry = time.Second

// watchEvent is one node's event on its way into the merged stream.
type watchEvent struct {
	node *node
	ev   *hypervisorv1.WatchVirtualMachinesResponse
	// synced: the node's first snapshot is complete, or its first attempt
	// failed (the fleet's SYNCED waits for every node's).
	synced bool
}

// WatchVirtualMachines merges the nodes' watch streams. A watch of one VM
// goes to its node as it is (revisions and resumes are the node's). A fleet
// watch snapshots every node, sends one SYNCED when all have (or failed),
// then every change; its revisions count the merged stream's messages, so
// it does not resume (since_revision is refused with out_of_range: list,
// then watch). A node whose stream ends is a WARNING event naming it; the
// fleet resumes that node's stream from its last revision as soon as it
// answers again, then says so in another WARNING.
func (h *Hypervisor) WatchVirtualMachines(req *hypervisorv1.WatchVirtualMachinesRequest, ss grpc.ServerStreamingServer[hypervisorv1.WatchVirtualMachinesResponse]) error {
	ctx := ss.Context()
	if req.GetId() != "" {
		n, err := h.r.forVM(req.GetId())
		if err != nil {
			return err
		}
		cs, err := n.hv.WatchVirtualMachines(ctx, req)
		if err != nil {
			return nodeErr(ctx, n, err)
		}
		for {
			ev, err := cs.Recv()
			if err != nil {
				return nodeErr(ctx, n, err)
			}
			if ev.Vm != nil {
				ev.Vm.Node = n.Name
			}
			if err := ss.Send(ev); err != nil {
				return err
			}
		}
	}
	if req.GetSinceRevision() != 0 {
		return apierr.Errorf(apierr.OutOfRange, "a fleet watch does not resume: list, then watch without since_revision (or watch one VM by id, which resumes on its node)")
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	events := make(chan watchEvent)
	// running are the nodes watched, with the connection each watch uses:
	// a member dialled anew (a new address) is watched anew.
	type watched struct {
		stop context.CancelFunc
		n    *node
	}
	running := map[int]watched{}
	defer func() {
		for _, w := range running {
			w.stop()
		}
	}()
	ns, changed := h.r.nodes()
	pending := map[int]bool{}
	start := func(n *node) {
		nctx, stop := context.WithCancel(ctx)
		running[n.Index] = watched{stop, n}
		go h.watchNode(nctx, n, req, events)
	}
	for _, n := range ns {
		pending[n.Index] = true
		start(n)
	}
	var rev uint64
	send := func(ev *hypervisorv1.WatchVirtualMachinesResponse) error {
		rev++
		ev.Revision = rev
		return ss.Send(ev)
	}
	if len(pending) == 0 {
		if err := send(&hypervisorv1.WatchVirtualMachinesResponse{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED}); err != nil {
			return err
		}
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-changed:
			// Members joined or left: watch the new ones, stop the gone.
			var now []*node
			now, changed = h.r.nodes()
			seen := map[int]bool{}
			for _, n := range now {
				seen[n.Index] = true
				if w, ok := running[n.Index]; !ok || w.n.conn != n.conn {
					if ok {
						w.stop()
					}
					start(n)
				}
			}
			for i, w := range running {
				if !seen[i] {
					w.stop()
					delete(running, i)
					delete(pending, i)
					if err := send(warningEvent(fmt.Sprintf("node with index %d left the fleet", i))); err != nil {
						return err
					}
				}
			}
		case e := <-events:
			if w, ok := running[e.node.Index]; !ok || w.n != e.node {
				continue // a stopped node's last word
			}
			if e.synced {
				if pending[e.node.Index] {
					delete(pending, e.node.Index)
					if len(pending) == 0 {
						if err := send(&hypervisorv1.WatchVirtualMachinesResponse{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED}); err != nil {
							return err
						}
					}
				}
				continue
			}
			if e.ev.Vm != nil {
				e.ev.Vm.Node = e.node.Name
			}
			if err := send(e.ev); err != nil {
				return err
			}
		}
	}
}

func warningEvent(msg string) *hypervisorv1.WatchVirtualMachinesResponse {
	return &hypervisorv1.WatchVirtualMachinesResponse{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_WARNING, Warning: msg}
}

// watchNode feeds one node's events into out until ctx ends, reopening the
// stream after it ends: from the last revision seen, or with a fresh
// snapshot when the node no longer retains it (or none was seen).
func (h *Hypervisor) watchNode(ctx context.Context, n *node, req *hypervisorv1.WatchVirtualMachinesRequest, out chan<- watchEvent) {
	emit := func(e watchEvent) bool {
		select {
		case out <- e:
			return true
		case <-ctx.Done():
			return false
		}
	}
	var last uint64
	synced, down := false, false
	for {
		err := func() error {
			if n.conn == nil { // restarted when a new member set dials it
				return unavailable(n, n.dialErr.Error())
			}
			cs, err := n.hv.WatchVirtualMachines(ctx, &hypervisorv1.WatchVirtualMachinesRequest{Name: req.GetName(), SinceRevision: last})
			if err != nil {
				return err
			}
			for {
				ev, err := cs.Recv()
				if err != nil {
					return err
				}
				if down {
					down = false
					if !emit(watchEvent{node: n, ev: warningEvent(fmt.Sprintf("node %s is back; its events resume", n.Name))}) {
						return nil
					}
				}
				if ev.GetRevision() > last {
					last = ev.GetRevision()
				}
				if ev.GetType() == hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED {
					if !synced {
						synced = true
						if !emit(watchEvent{node: n, synced: true}) {
							return nil
						}
					}
					continue
				}
				if !emit(watchEvent{node: n, ev: ev}) {
					return nil
				}
			}
		}()
		if ctx.Err() != nil {
			return
		}
		if apierr.CodeOf(err) == apierr.OutOfRange {
			last = 0 // its window moved on: snapshot it again
		}
		if !synced {
			synced = true
			if !emit(watchEvent{node: n, synced: true}) {
				return
			}
		}
		if !down {
			down = true
			if !emit(watchEvent{node: n, ev: warningEvent(fmt.Sprintf("node %s: its watch ended (%s); its events are missing until it is back", n.Name, apierr.MessageOf(nodeErr(ctx, n, err))))}) {
				return
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(watchRetry):
		}
	}
}
