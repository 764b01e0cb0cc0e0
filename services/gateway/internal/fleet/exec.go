package fleet

import (
	"context"
	"io"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
)

// ExecVirtualMachineStream relays a streamed exec to the VM's node, named
// by the first message's start.id.
func (h *Hypervisor) ExecVirtualMachineStream(ss grpc.BidiStreamingServer[hypervisorv1.ExecVirtualMachineStreamRequest, hypervisorv1.ExecVirtualMachineStreamResponse]) error {
	ctx := ss.Context()
	first, err := ss.Recv()
	if err != nil {
		return err
	}
	if first.GetStart() == nil {
		return apierr.Invalidf("start", "the first message must be start")
	}
	n, err := h.r.forVM(first.GetStart().GetId())
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	cs, err := n.hv.ExecVirtualMachineStream(ctx)
	if err != nil {
		return nodeErr(ctx, n, err)
	}
	if err := cs.Send(first); err != nil {
		return nodeErr(ctx, n, recvErr(cs))
	}
	go func() {
		for {
			m, err := ss.Recv()
			if err != nil {
				_ = cs.CloseSend()
				return
			}
			if cs.Send(m) != nil {
				return
			}
		}
	}()
	for {
		m, err := cs.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return nodeErr(ctx, n, err)
		}
		if err := ss.Send(m); err != nil {
			return err
		}
	}
}

// recvErr is the status a stream ended with, after a Send failed.
func recvErr(cs grpc.ClientStream) error {
	var m hypervisorv1.ExecVirtualMachineStreamResponse
	if err := cs.RecvMsg(&m); err != nil && err != io.EOF {
		return err
	}
	return apierr.Errorf(apierr.Unavailable, "the node ended the stream")
}
