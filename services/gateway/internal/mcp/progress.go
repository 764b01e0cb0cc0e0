package mcp

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/sdk/enumname"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// syncTimeout bounds how long create_vm waits for its watch to be in place
// before it creates the VM anyway (progress then starts late, not wrong).
var syncTimeout = 5 * time.Second

// progress reports a VM's state changes as MCP progress notifications while
// CreateVirtualMachine blocks, from a watch of the VMs of that name
// (WatchVirtualMachines): the create starts once the watch is synced, so
// the first VM of that name that the watch did not list in its snapshot is
// the one this call creates (a VM of the name already there is someone
// else's, and the create fails with a conflict).
type progress struct {
	hv      hypervisorv1.HypervisorServiceClient
	session *mcp.ServerSession
	token   any
	name    string
	log     *slog.Logger

	known map[string]bool // in the snapshot: not ours
	id    string
	state string
	n     int
}

func newProgress(hv hypervisorv1.HypervisorServiceClient, ss *mcp.ServerSession, token any, name string, log *slog.Logger) *progress {
	return &progress{hv: hv, session: ss, token: token, name: name, log: log, known: map[string]bool{}}
}

// start opens the watch and returns once it is synced; stop ends it, then
// reports the created VM's state if it is news, so no notification follows
// the tool result.
func (p *progress) start(ctx context.Context) (stop func(*hypervisorv1.VirtualMachine)) {
	wctx, cancel := context.WithCancel(ctx)
	synced := make(chan struct{})
	var once sync.Once
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer once.Do(func() { close(synced) })
		p.follow(wctx, ctx, func() { once.Do(func() { close(synced) }) })
	}()
	select {
	case <-synced:
	case <-time.After(syncTimeout):
		p.log.Debug("create_vm progress: watch not synced in time", "name", p.name)
	}
	return func(vm *hypervisorv1.VirtualMachine) {
		cancel()
		<-done
		if vm != nil && vm.GetId() != "" {
			p.report(ctx, vm)
		}
	}
}

// follow reads the watch until wctx ends; a stream cut off (the watcher fell
// behind, a backend restarted) resumes from its last revision, a few times.
func (p *progress) follow(wctx, ctx context.Context, synced func()) {
	var since uint64
	for attempt := 0; attempt < 3; attempt++ {
		stream, err := p.hv.WatchVirtualMachines(wctx, &hypervisorv1.WatchVirtualMachinesRequest{Name: p.name, SinceRevision: since})
		for err == nil {
			var msg *hypervisorv1.WatchVirtualMachinesResponse
			if msg, err = stream.Recv(); err != nil {
				break
			}
			switch msg.GetType() {
			case hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SNAPSHOT:
				p.known[msg.GetVm().GetId()] = true
				continue
			case hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED:
				synced()
			case hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_CHANGED, hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_DELETED:
				vm := msg.GetVm()
				if p.id == "" && !p.known[vm.GetId()] {
					p.id = vm.GetId()
				}
				if vm.GetId() == p.id {
					p.report(ctx, vm)
				}
			}
			since = msg.GetRevision()
		}
		if wctx.Err() != nil {
			return
		}
		p.log.Debug("create_vm progress: watch", "name", p.name, "since_revision", since, "error", err)
		if c := apierr.CodeOf(err); since == 0 || (c != apierr.ResourceExhausted && c != apierr.Unavailable) {
			return
		}
	}
}

func (p *progress) report(ctx context.Context, vm *hypervisorv1.VirtualMachine) {
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
