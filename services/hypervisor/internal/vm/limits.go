package vm

import (
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

func (l *Limits) defaults() {
	if l.MaxVMs <= 0 {
		l.MaxVMs = DefaultMaxVMs
	}
	if l.MaxNetworks <= 0 {
		l.MaxNetworks = DefaultMaxNetworks
	}
	if l.MaxForwardsPerVM <= 0 {
		l.MaxForwardsPerVM = DefaultMaxForwardsPerVM
	}
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

// refusals counts the creates each per-host bound refused.
type refusals [limitCount]atomic.Uint64

func (m *Manager) refuse(idx int, format string, args ...any) error {
	m.refused[idx].Add(1)
	return apierr.Errorf(apierr.ResourceExhausted, format, args...)
}

// Refusals are the creates refused at each per-host bound since the
// hypervisor started, by bound (LimitVMs, LimitNetworks, LimitForwardsPerVM).
func (m *Manager) Refusals() map[string]uint64 {
	out := make(map[string]uint64, limitCount)
	for i, n := range limitNames {
		out[n] = m.refused[i].Load()
	}
	return out
}

// BoundCounters are what the bounds refused or cut since the hypervisor
// started (TelemetryService): per VM, its IMDS refusals and console
// rotations; per host, the creates refused.
func (m *Manager) BoundCounters() *hypervisorv1.GetBoundCountersResponse {
	out := &hypervisorv1.GetBoundCountersResponse{RefusedTotal: m.Refusals(), LifetimeActionsTotal: m.LifetimeActions()}
	_, out.RefusedTotal[LimitWatchers], out.RefusedTotal[LimitWatchBuffer] = m.WatchCounters()
	imdsByVM := map[string]imds.Counters{}
	for _, c := range m.imds.Counters() {
		imdsByVM[c.VMID] = c
	}
	for id, con := range m.ConsoleCounters() {
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
