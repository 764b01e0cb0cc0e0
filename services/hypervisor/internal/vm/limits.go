package vm

import (
	"github.com/giantswarm/vm-manager/pkg/bound"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/network"
	"maps"
	"slices"
	"strings"
	"sync/atomic"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
)

// Limits bound what callers can make one host hold. A create over a bound is
// refused before anything is allocated; existing VMs, networks and forwards
// are never removed for a bound lowered since (a restart with a smaller
// --max-vms keeps them all and refuses creates until they fit again).
type Limits struct {
	// MaxVMs bounds the VM records, whatever their state (--max-vms).
	MaxVMs int
	// MaxNetworks bounds the networks, the default one included (--max-networks).
	MaxNetworks int
	// MaxForwardsPerVM bounds one VM's port forwards (--max-forwards-per-vm);
	// with MaxVMs it bounds the host's listening sockets.
	MaxForwardsPerVM int
	// MaxMemoryMiB and MaxCPUs bound one VM's size (--max-memory-mib,
	// --max-cpus); 0: only the fixed bounds (256 CPUs, no memory maximum).
	// The server fills them from the host's MemTotal and CPU count.
	MaxMemoryMiB int32
	MaxCPUs      int32
}

// Defaults of the bounds, and the fixed bounds of a create request's
// ssh_authorized_keys (served one by one at public-keys/{n}).
const (
	DefaultMaxVMs           = 100
	DefaultMaxNetworks      = 32
	DefaultMaxForwardsPerVM = 16

	MaxSSHKeys     = 32
	MaxSSHKeyBytes = 8 << 10
)

// defaults: one bound.Default a field, like imds.Limits' (the same shape;
// kept, each list names its own fields).
func (l *Limits) defaults() {
	bound.Default(&l.MaxVMs, DefaultMaxVMs)
	bound.Default(&l.MaxNetworks, DefaultMaxNetworks)
	bound.Default(&l.MaxForwardsPerVM, DefaultMaxForwardsPerVM)
}

// The per-host bounds, as refusals are counted.
const (
	LimitVMs           = "vms"
	LimitNetworks      = "networks"
	LimitForwardsPerVM = "forwards_per_vm"
)

// Indexes of the refusal counters.
const (
	limitVMs = iota
	limitNetworks
	limitForwards
	limitCount
)

var limitNames = [limitCount]string{LimitVMs, LimitNetworks, LimitForwardsPerVM}

// Refusals counts the creates each per-host bound refused (the networks'
// are the network registry's).
type Refusals struct{ n [limitCount]atomic.Uint64 }

func (r *Refusals) refuse(idx int, format string, args ...any) error {
	r.n[idx].Add(1)
	return apierr.Errorf(apierr.ResourceExhausted, format, args...)
}

// Bounds are the counters of every bound, gathered from their owners.
type Bounds struct {
	refused  *Refusals
	nets     *network.Registry
	activity *Activity
	watches  *Watches
	imds     *imds.Guard
	consoles *Consoles
}

// NewBounds gathers the counters of its arguments.
func NewBounds(refused *Refusals, nets *network.Registry, activity *Activity, watches *Watches, guard *imds.Guard, consoles *Consoles) *Bounds {
	return &Bounds{refused: refused, nets: nets, activity: activity, watches: watches, imds: guard, consoles: consoles}
}

// Refusals are the creates refused at each per-host bound since the
// hypervisor started, by bound (LimitVMs, LimitNetworks, LimitForwardsPerVM).
func (b *Bounds) Refusals() map[string]uint64 {
	out := make(map[string]uint64, limitCount)
	for i, n := range limitNames {
		out[n] = b.refused.n[i].Load()
	}
	out[LimitNetworks] = b.nets.Refused()
	return out
}

// BoundCounters are what the bounds refused or cut since the hypervisor
// started (TelemetryService): per VM, its IMDS refusals and console
// rotations; per host, the creates refused.
func (b *Bounds) BoundCounters() *hypervisorv1.GetBoundCountersResponse {
	out := &hypervisorv1.GetBoundCountersResponse{RefusedTotal: b.Refusals(), LifetimeActionsTotal: b.activity.LifetimeActions()}
	_, out.RefusedTotal[LimitWatchers], out.RefusedTotal[LimitWatchBuffer] = b.watches.WatchCounters()
	imdsByVM := map[string]imds.Counters{}
	for _, c := range b.imds.Counters() {
		imdsByVM[c.VMID] = c
	}
	for id, con := range b.consoles.ConsoleCounters() {
		c := imdsByVM[id]
		tooLarge := map[string]uint64{imds.BodyQuote: 0, imds.BodyReport: 0}
		maps.Copy(tooLarge, c.BodiesTooLarge)
		out.Vms = append(out.Vms, &hypervisorv1.VirtualMachineBoundCounters{
			VmId:                     id,
			ImdsRateLimitedTotal:     c.RateLimited,
			ImdsBodyTooLargeTotal:    tooLarge,
			ConsoleRotationsTotal:    con.Rotations,
			ConsoleRotatedBytesTotal: con.RotatedBytes,
			ConsoleDroppedBytesTotal: con.DroppedBytes,
		})
	}
	slices.SortFunc(out.Vms, func(a, b *hypervisorv1.VirtualMachineBoundCounters) int {
		return strings.Compare(a.GetVmId(), b.GetVmId())
	})
	return out
}
