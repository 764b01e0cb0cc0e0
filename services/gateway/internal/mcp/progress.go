package mcp

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/giantswarm/vm-manager/gen/enumname"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// progressInterval is how often create_vm polls the VM it waits for.
var progressInterval = time.Second

// progress reports a VM's state changes as MCP progress notifications while
// CreateVirtualMachine blocks. The VM id is unknown until the record exists,
// so it first looks the VM up by name among the VMs created since the call
// started, then follows it by id.
type progress struct {
	hv      hypervisorv1.HypervisorServiceClient
	session *mcp.ServerSession
	token   any
	name    string
	log     *slog.Logger

	since time.Time
	id    string
	state string
	n     int
}

func newProgress(hv hypervisorv1.HypervisorServiceClient, ss *mcp.ServerSession, token any, name string, log *slog.Logger) *progress {
	return &progress{hv: hv, session: ss, token: token, name: name, log: log, since: time.Now()}
}

// start polls until the returned stop is called; stop waits for the poller
// to end, then reports the created VM's state if it is news, so no
// notification follows the tool result.
func (p *progress) start(ctx context.Context) (stop func(*hypervisorv1.VirtualMachine)) {
	pctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(progressInterval)
		defer tick.Stop()
		for {
			select {
			case <-pctx.Done():
				return
			case <-tick.C:
			}
			if vm := p.poll(pctx); vm != nil {
				p.report(ctx, vm)
			}
		}
	}()
	return func(vm *hypervisorv1.VirtualMachine) {
		cancel()
		<-done
		if vm != nil && vm.GetId() != "" {
			p.report(ctx, vm)
		}
	}
}

// poll returns the VM's current record, or nil if it is not (yet) known.
func (p *progress) poll(ctx context.Context) *hypervisorv1.VirtualMachine {
	if p.id != "" {
		vm, err := p.hv.GetVirtualMachine(ctx, &hypervisorv1.GetVirtualMachineRequest{Id: p.id})
		if err != nil {
			if ctx.Err() == nil {
				p.log.Debug("create_vm progress: get vm", "id", p.id, "error", err)
			}
			return nil
		}
		return vm
	}
	resp, err := p.hv.ListVirtualMachines(ctx, &hypervisorv1.ListVirtualMachinesRequest{})
	if err != nil {
		if ctx.Err() == nil {
			p.log.Debug("create_vm progress: list vms", "name", p.name, "error", err)
		}
		return nil
	}
	for _, vm := range resp.GetVms() {
		if vm.GetName() != p.name {
			continue
		}
		// A VM of that name created before this call is someone else's
		// (the create will fail with a conflict).
		if c := vm.GetCreatedAt(); c != nil && c.AsTime().Before(p.since.Add(-2*time.Second)) {
			continue
		}
		return vm
	}
	return nil
}

func (p *progress) report(ctx context.Context, vm *hypervisorv1.VirtualMachine) {
	if p.id == "" {
		p.id = vm.GetId()
	}
	state := enumname.Of(vm.GetState())
	if state == p.state {
		return
	}
	p.state = state
	p.n++
	err := p.session.NotifyProgress(ctx, &mcp.ProgressNotificationParams{
		ProgressToken: p.token,
		Progress:      float64(p.n),
		Message:       fmt.Sprintf("vm %s is %s", vm.GetId(), state),
	})
	if err != nil {
		p.log.Debug("create_vm progress: notify", "id", vm.GetId(), "error", err)
	}
}
