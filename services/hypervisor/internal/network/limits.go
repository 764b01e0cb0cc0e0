package network

import (
	"sync/atomic"
	"time"

	"github.com/giantswarm/vm-manager/pkg/bound"
)

// Defaults of Limits. A UDP flow costs the host one socket and two
// goroutines, a TCP flow one socket and a proxy; the per-VM bounds keep one
// guest well below the process's descriptor limit, the host bound keeps all
// of them together below it.
const (
	DefaultNATTCPPerVM     = 512
	DefaultNATUDPPerVM     = 128
	DefaultNATFlows        = 8192
	DefaultNATUDPIdle      = 30 * time.Second
	DefaultIMDSConnsPerVM  = 16
	DefaultIMDSReadTimeout = 60 * time.Second
	DefaultIMDSIdleTimeout = 60 * time.Second

	// imdsHeaderTimeout bounds a request's line and headers (within the
	// read timeout, if that is shorter).
	imdsHeaderTimeout = 10 * time.Second
	// natDialTimeout bounds a NAT TCP connect to the destination; the
	// flow counts against the VM's bound meanwhile.
	natDialTimeout = 30 * time.Second
	// natKeepalive probes the guest's end of an idle NAT TCP flow, so a
	// guest that went away (reset, deleted) frees its flows.
	natKeepalive = 60 * time.Second
	// maxTCPInFlight is gVisor's bound on SYNs being handled at once per
	// network; the per-VM bound is what stops one VM from taking them all.
	maxTCPInFlight = 4096
)

// Limits bound what a VM can make its network hold on the host and how long
// the IMDS waits for it. Zero fields take the defaults.
type Limits struct {
	// NATTCPPerVM and NATUDPPerVM bound one VM's open NAT flows, each a
	// socket on the host (--max-nat-flows-tcp, --max-nat-flows-udp).
	NATTCPPerVM, NATUDPPerVM int
	// NATUDPIdle ends a UDP flow after this long without a datagram in
	// either direction (--nat-udp-idle-timeout).
	NATUDPIdle time.Duration
	// Host bounds the NAT flows of all networks together (--max-nat-flows);
	// nil: no host bound.
	Host *FlowBudget
	// IMDSConnsPerVM bounds one VM's open IMDS connections
	// (--max-imds-connections).
	IMDSConnsPerVM int
	// IMDSReadTimeout bounds reading one request, body included (and, as
	// net/http does, its handler's context); IMDSIdleTimeout closes a
	// kept-alive connection without a next request (--imds-read-timeout,
	// --imds-idle-timeout).
	IMDSReadTimeout, IMDSIdleTimeout time.Duration
}

func (l Limits) withDefaults() Limits {
	bound.Default(&l.NATTCPPerVM, DefaultNATTCPPerVM)
	bound.Default(&l.NATUDPPerVM, DefaultNATUDPPerVM)
	bound.Default(&l.IMDSConnsPerVM, DefaultIMDSConnsPerVM)
	bound.Default(&l.NATUDPIdle, DefaultNATUDPIdle)
	bound.Default(&l.IMDSReadTimeout, DefaultIMDSReadTimeout)
	bound.Default(&l.IMDSIdleTimeout, DefaultIMDSIdleTimeout)
	return l
}

// FlowBudget is the host's NAT flows, shared by its networks.
type FlowBudget struct {
	max  int64
	used atomic.Int64
}

// NewFlowBudget returns a budget of n flows (at least 1).
func NewFlowBudget(n int) *FlowBudget { return &FlowBudget{max: int64(max(n, 1))} }

func (b *FlowBudget) acquire() bool {
	if b == nil {
		return true
	}
	if b.used.Add(1) > b.max {
		b.used.Add(-1)
		return false
	}
	return true
}

func (b *FlowBudget) release() {
	if b != nil {
		b.used.Add(-1)
	}
}

// Used is the number of NAT flows open on the host.
func (b *FlowBudget) Used() int { return int(b.used.Load()) }
