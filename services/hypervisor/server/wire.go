package server

import (
	"context"
	"log/slog"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/apiserver"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/guestapi"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/network"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/notify"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/pool"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore"
)

// vms are the VM core's parts (docs/development.md draws them), wired here
// so that every dependency is visible in one place.
type vms struct {
	table    *vm.Table
	manager  *vm.Manager
	activity *vm.Activity
	access   *vm.Access
	watches  *vm.Watches
	consoles *vm.Consoles
	bounds   *vm.Bounds
	nets     *network.Registry
	guest    *guestapi.Side
	pools    *pool.Pools
	cancel   context.CancelFunc
	log      *slog.Logger

	stopPools context.CancelFunc
	poolsDone chan struct{}
}

// wireVMs loads the records, restores the networks, then re-adopts the VMs
// (re-adopted VMs redial their network's socket). No loop runs yet (run).
func wireVMs(cfg vm.Config, poolCfg pool.Config, log *slog.Logger, st *vmstore.Store, images vm.ImageResolver, verifier attestationv1.VerifierServiceClient, router *notify.Router, drv vm.Driver) (*vms, error) {
	cfg = cfg.WithDefaults()
	table, err := vm.NewTable(cfg, log, st)
	if err != nil {
		return nil, err
	}
	pools, err := pool.New(poolCfg, log.With("component", "pools"), st)
	if err != nil {
		return nil, err
	}
	activity := vm.NewActivity(cfg, log, table)
	guard := imds.NewGuard(cfg.IMDS)
	boots := vm.NewBoots(cfg.Firmware, images)
	guest := guestapi.New(table, boots, verifier, guestapi.Config{ImageDir: cfg.ImageDir, SeriesLimit: cfg.GuestSeriesLimit}, log)
	ctx, cancel := context.WithCancel(context.Background())
	nets := network.NewRegistry(ctx, st, vm.IMDSHandler(table, activity, guest, guard, log), table.AttachedTo, cfg.Limits.MaxNetworks, cfg.Network, log)
	if err := nets.Restore(cfg.DefaultNetwork, cfg.DefaultSubnet); err != nil {
		cancel()
		return nil, err
	}
	refused := &vm.Refusals{}
	runner := vm.NewRunner(cfg, log, vm.RunnerDeps{Table: table, Driver: drv, Images: images, Verifier: verifier, Router: router,
		Networks: nets, Activity: activity, Boots: boots})
	access := vm.NewAccess(cfg, log, table, nets, activity, guest, refused)
	manager := vm.New(cfg, log, vm.Deps{Store: st, Images: images, Verifier: verifier, Driver: drv, Table: table, Runner: runner,
		Activity: activity, Access: access, Networks: nets, IMDS: guard, Refusals: refused, Pools: pools})
	watches := vm.NewWatches(cfg.Watch, table.Events())
	consoles := vm.NewConsoles(cfg, log, table)
	return &vms{table: table, manager: manager, activity: activity, access: access, watches: watches, consoles: consoles,
		bounds: vm.NewBounds(refused, nets, activity, watches, guard, consoles), nets: nets, guest: guest, pools: pools, cancel: cancel, log: log}, nil
}

// run starts the background loops: forgets, lifetimes, console rotation,
// the pools' refills.
func (v *vms) run() {
	v.manager.RunLoops()
	v.consoles.Run()
	ctx, cancel := context.WithCancel(context.Background())
	v.stopPools, v.poolsDone = cancel, make(chan struct{})
	go func() {
		defer close(v.poolsDone)
		v.pools.Run(ctx, v.manager)
	}()
}

// endWatches ends the watch streams (they never end by themselves) when
// the drain starts.
func (v *vms) endWatches() { v.watches.End() }

// close stops supervising (the VMs run on for the next hypervisor unless
// --detach-vms-on-exit=false), then the networks, the watches and the table.
func (v *vms) close() {
	if v.stopPools != nil {
		v.stopPools() // refills end before the manager they call
		<-v.poolsDone
	}
	v.manager.Close()
	v.consoles.Close()
	v.nets.Close()
	v.cancel()
	v.watches.End()
	if err := v.table.Close(); err != nil {
		v.log.Error("store the watch revision", "error", err)
	}
}

// api is the HypervisorService's view of the parts.
func (v *vms) api(host apiserver.HostProber, catalog apiserver.Catalog) apiserver.Deps {
	return apiserver.Deps{Host: host, Catalog: catalog, VMs: v.table, Lifecycle: v.manager, Lifetimes: v.activity, Access: v.access,
		Consoles: v.consoles, Watches: v.watches, Networks: v.nets, Guests: v.guest, Bounds: v.bounds, Pools: v.pools}
}
