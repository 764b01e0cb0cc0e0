package fleet

import (
	"context"
	"fmt"
	"io"
	"strings"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// ImportImage imports on the named node, relaying its stream as it comes,
// or, without node, on every node at once, as CreateNetwork creates: the
// catalog is per node, and an image imported fleet-wide is there wherever a
// VM is placed. A fleet-wide import streams the nodes' progress merged
// (aggregateImport), then one DONE: the lowest-index node's image (with its
// node), unchanged when it was on every node already. When some nodes fail,
// what the others imported stays and the call fails naming the nodes (a
// retry answers unchanged where it is). Cancelling the call cancels every
// node's import.
func (h *Hypervisor) ImportImage(req *hypervisorv1.ImportImageRequest, ss grpc.ServerStreamingServer[hypervisorv1.ImportImageResponse]) error {
	ctx := ss.Context()
	fwd := proto.CloneOf(req)
	fwd.Node = "" // the node never sees the fleet's field
	if req.GetNode() != "" {
		n, err := h.r.named(req.GetNode())
		if err != nil {
			return err
		}
		return relayImport(ctx, n, fwd, ss.Send)
	}
	return h.importEverywhere(ctx, fwd, ss.Send)
}

// relayImport runs one node's import, handing each message to send with
// the node stamped on the image, until the node's stream ends.
func relayImport(ctx context.Context, n *node, req *hypervisorv1.ImportImageRequest, send func(*hypervisorv1.ImportImageResponse) error) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	cs, err := n.hv.ImportImage(ctx, req)
	if err != nil {
		return nodeErr(ctx, n, err)
	}
	for {
		m, err := cs.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return nodeErr(ctx, n, err)
		}
		if m.GetImage() != nil {
			m.Image.Node = n.Name
		}
		if err := send(m); err != nil {
			return err
		}
	}
}

// nodeImport is one node's part of a fleet-wide import.
type nodeImport struct {
	node  *node
	phase hypervisorv1.ImportPhase // the last phase it reported
	// bytesDone and bytesTotal are its last layer counts, kept through the
	// later phases so that the merged counts do not go back.
	bytesDone, bytesTotal int64
	done                  *hypervisorv1.ImportImageResponse
	err                   error
	ended                 bool
}

// importUpdate is a node's message, or the end of its stream (end, err).
type importUpdate struct {
	i   int
	msg *hypervisorv1.ImportImageResponse
	end bool
	err error
}

// importEverywhere runs the import on every node at once (without the
// fan-out's node timeout: an import takes as long as its layers) and
// merges the streams into send.
func (h *Hypervisor) importEverywhere(ctx context.Context, req *hypervisorv1.ImportImageRequest, send func(*hypervisorv1.ImportImageResponse) error) error {
	ns, _ := h.r.nodes()
	if len(ns) == 0 {
		return apierr.Errorf(apierr.Unavailable, "no fleet nodes known")
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	nodes := make([]nodeImport, len(ns))
	updates := make(chan importUpdate)
	running := 0
	for i, n := range ns {
		nodes[i].node = n
		if err := n.usable(); err != nil {
			nodes[i].err, nodes[i].ended = err, true
			continue
		}
		running++
		go func() {
			err := relayImport(ctx, n, req, func(m *hypervisorv1.ImportImageResponse) error {
				select {
				case updates <- importUpdate{i: i, msg: m}:
					return nil
				case <-ctx.Done():
					return ctx.Err()
				}
			})
			select {
			case updates <- importUpdate{i: i, end: true, err: err}:
			case <-ctx.Done():
			}
		}()
	}
	for running > 0 {
		var u importUpdate
		select {
		case <-ctx.Done():
			return ctx.Err()
		case u = <-updates:
		}
		ni := &nodes[u.i]
		if u.end {
			running--
			ni.ended = true
			ni.err = u.err
			if ni.err == nil && ni.done == nil {
				ni.err = apierr.Errorf(apierr.Internal, "fleet node %s ended the import without its result", ni.node.Name)
			}
			continue
		}
		if u.msg.GetPhase() == hypervisorv1.ImportPhase_IMPORT_PHASE_DONE {
			ni.done, ni.phase = u.msg, u.msg.GetPhase()
			continue
		}
		ni.phase = u.msg.GetPhase()
		if u.msg.GetPhase() == hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS {
			ni.bytesDone, ni.bytesTotal = u.msg.GetBytesDone(), u.msg.GetBytesTotal()
		}
		if m := aggregateImport(nodes, u.msg); m != nil {
			if err := send(m); err != nil {
				return err
			}
		}
	}
	var failed []string
	var firstErr error
	var first *hypervisorv1.ImportImageResponse
	unchanged := true
	for _, ni := range nodes {
		if ni.err != nil {
			failed = append(failed, fmt.Sprintf("%s: %s", ni.node.Name, apierr.MessageOf(ni.err)))
			if firstErr == nil {
				firstErr = ni.err
			}
			continue
		}
		if first == nil {
			first = ni.done
		}
		unchanged = unchanged && ni.done.GetUnchanged()
	}
	if firstErr != nil {
		if len(failed) == len(nodes) {
			return apierr.Errorf(apierr.CodeOf(firstErr), "failed on every fleet node: %s", strings.Join(failed, "; "))
		}
		return apierr.Errorf(apierr.CodeOf(firstErr), "failed on %d of %d fleet nodes (the others imported it): %s",
			len(failed), len(nodes), strings.Join(failed, "; "))
	}
	out := proto.CloneOf(first)
	out.Unchanged = unchanged
	return send(out)
}

// aggregateImport is the merged progress after a node's message latest: the
// phase of the node furthest behind among those still importing, the layer
// bytes of all nodes summed, latest's layer. Nil when every node still
// importing is done (the merged DONE comes once all have ended).
func aggregateImport(nodes []nodeImport, latest *hypervisorv1.ImportImageResponse) *hypervisorv1.ImportImageResponse {
	out := &hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_DONE}
	for _, ni := range nodes {
		if ni.err != nil {
			continue
		}
		out.BytesDone += ni.bytesDone
		out.BytesTotal += ni.bytesTotal
		if ni.ended || ni.done != nil {
			continue
		}
		out.Phase = min(out.Phase, max(ni.phase, hypervisorv1.ImportPhase_IMPORT_PHASE_RESOLVING))
	}
	if out.Phase == hypervisorv1.ImportPhase_IMPORT_PHASE_DONE {
		return nil
	}
	if out.Phase == hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS && latest.GetPhase() == hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS {
		out.Layer = latest.GetLayer()
	}
	return out
}
