package vm

import (
	"context"
	"log/slog"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/guestapi"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/network"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/notify"
)

// testVMs are the parts wired as server/ wires them, with every part's
// methods at hand for the tests.
type testVMs struct {
	*Manager
	*Table
	*Runner
	*Activity
	*Access
	*Watches
	*Consoles
	*Bounds

	log    *slog.Logger
	store  Store
	nets   *network.Registry
	guest  *guestapi.Side
	cancel context.CancelFunc
}

// assemble wires the parts over st (server/ does the same).
func assemble(cfg Config, log *slog.Logger, st Store, images ImageResolver, v attestationv1.VerifierServiceClient, router *notify.Router, drv Driver, pools ...Pools) (*testVMs, error) {
	cfg = cfg.WithDefaults()
	table, err := NewTable(cfg, log, st)
	if err != nil {
		return nil, err
	}
	activity := NewActivity(cfg, log, table)
	guard := imds.NewGuard(cfg.IMDS)
	boots := NewBoots(cfg.Firmware, images)
	guest := guestapi.New(table, boots, v, guestapi.Config{ImageDir: cfg.ImageDir, SeriesLimit: cfg.GuestSeriesLimit}, log)
	ctx, cancel := context.WithCancel(context.Background())
	nets := network.NewRegistry(ctx, st, IMDSHandler(table, activity, guest, guard, log), table.AttachedTo, cfg.Limits.MaxNetworks, cfg.Network, log)
	if err := nets.Restore(cfg.DefaultNetwork, cfg.DefaultSubnet); err != nil {
		cancel()
		return nil, err
	}
	refused := &Refusals{}
	runner := NewRunner(cfg, log, RunnerDeps{Table: table, Driver: drv, Images: images, Verifier: v, Router: router, Networks: nets, Activity: activity, Boots: boots})
	access := NewAccess(cfg, log, table, nets, activity, guest, refused)
	m := New(cfg, log, Deps{Store: st, Images: images, Verifier: v, Driver: drv, Table: table, Runner: runner, Activity: activity,
		Access: access, Networks: nets, IMDS: guard, Refusals: refused, Pools: firstOr(pools)})
	watches := NewWatches(cfg.Watch, table.Events())
	consoles := NewConsoles(cfg, log, table)
	return &testVMs{Manager: m, Table: table, Runner: runner, Activity: activity, Access: access, Watches: watches, Consoles: consoles,
		Bounds: NewBounds(refused, nets, activity, watches, guard, consoles), log: log, store: st, nets: nets, guest: guest, cancel: cancel}, nil
}

// RunLoops runs the loops server/ runs.
func (v *testVMs) RunLoops() {
	v.Manager.RunLoops()
	v.Consoles.Run()
}

// Close closes the parts in server/'s order.
func (v *testVMs) Close() {
	v.Manager.Close()
	v.Consoles.Close()
	v.nets.Close()
	v.cancel()
	v.Watches.End()
	if err := v.Table.Close(); err != nil {
		v.log.Error("store the watch revision", "error", err)
	}
}

// Guest is the guest side the IMDS serves from.
func (v *testVMs) Guest() *guestapi.Side { return v.guest }

func firstOr(p []Pools) Pools {
	if len(p) == 0 {
		return nil
	}
	return p[0]
}
