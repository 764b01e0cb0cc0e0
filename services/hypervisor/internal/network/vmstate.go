package network

import (
	"io"
	"maps"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// Why a VM's packet, flow, lookup or connection was refused, as the metrics
// name it.
type (
	egressReason int
	natReason    int
	dnsReason    int
)

const (
	egressRule  egressReason = iota // not allowed by the rules or the default policy
	egressLocal                     // an address of the network that it does not serve
	numEgress
)

const (
	natTCPVM natReason = iota
	natTCPHost
	natUDPVM
	natUDPHost
	numNAT
	natNone natReason = -1
)

const (
	dnsPolicy dnsReason = iota // a name the network's DNS policy does not resolve
	dnsBusy                    // too many of the VM's lookups in flight
	dnsPins                    // the VM's pinned addresses are full
	numDNS
)

var (
	egressNames = [numEgress]string{"rule", "local"}
	natNames    = [numNAT]string{"tcp_vm_limit", "tcp_host_limit", "udp_vm_limit", "udp_host_limit"}
	dnsNames    = [numDNS]string{"policy", "busy", "pins"}
)

const (
	// pinTTL is how long a domain rule allows an address after the
	// network's DNS answered it; the answer carries it as its TTL. (The
	// host's resolver does not report TTLs, so the network sets its own.)
	// pinGrace covers a guest that uses its cached answer at the last moment.
	pinTTL   = 60 * time.Second
	pinGrace = 5 * time.Second
	// maxPinsPerVM bounds a VM's pinned (rule, address) pairs.
	maxPinsPerVM = 1024
	// maxDNSInFlight bounds a VM's lookups waiting for the host's resolver.
	maxDNSInFlight = 16
)

// flowKey is a NAT flow as the guest sees it.
type flowKey struct {
	proto    uint8
	src, dst netip.AddrPort // src is the VM's lease
}

type pinKey struct {
	rule int
	ip   netip.Addr
}

// vmState is one lease's accounting: counters, NAT flows, IMDS connections
// and pinned addresses. It lives from Allocate (or restore) to Release.
type vmState struct {
	id string
	ip netip.Addr

	dropped      atomic.Uint64 // anti-spoofing drops
	egress       [numEgress]atomic.Uint64
	nat          [numNAT]atomic.Uint64
	dns          [numDNS]atomic.Uint64
	imdsRefused  atomic.Uint64
	imdsTimedOut atomic.Uint64
	imdsConns    atomic.Int32
	dnsConns     atomic.Int32 // TCP connections to the network's DNS
	dnsInFlight  atomic.Int32

	mu       sync.Mutex
	flows    map[flowKey]io.Closer // nil value: being set up
	tcp, udp int
	pins     map[pinKey]time.Time
	gone     bool // released: flows are refused, open ones closed
}

func newVMState(id string, ip netip.Addr) *vmState {
	return &vmState{id: id, ip: ip, flows: map[flowKey]io.Closer{}, pins: map[pinKey]time.Time{}}
}

// openFlow reserves a NAT flow, or says which bound refused it (natNone
// when the VM is gone or the flow exists: a race with its teardown, dropped
// without counting).
func (v *vmState) openFlow(k flowKey, limit int, host *FlowBudget) (natReason, bool) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if _, dup := v.flows[k]; dup || v.gone {
		return natNone, false
	}
	n, vmLimit, hostLimit := &v.tcp, natTCPVM, natTCPHost
	if k.proto == protoUDP {
		n, vmLimit, hostLimit = &v.udp, natUDPVM, natUDPHost
	}
	if *n >= limit {
		return vmLimit, false
	}
	if !host.acquire() {
		return hostLimit, false
	}
	*n++
	v.flows[k] = nil
	return natNone, true
}

// setFlow registers what closes an open flow; a VM released meanwhile has it
// closed at once.
func (v *vmState) setFlow(k flowKey, c io.Closer) {
	v.mu.Lock()
	_, ok := v.flows[k]
	keep := ok && !v.gone
	if keep {
		v.flows[k] = c
	}
	v.mu.Unlock()
	if !keep {
		_ = c.Close()
	}
}

// closeFlow forgets a flow and frees its place; only the first call counts.
func (v *vmState) closeFlow(k flowKey, host *FlowBudget) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if _, ok := v.flows[k]; !ok {
		return
	}
	delete(v.flows, k)
	if k.proto == protoUDP {
		v.udp--
	} else {
		v.tcp--
	}
	host.release()
}

func (v *vmState) hasFlow(k flowKey) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	_, ok := v.flows[k]
	return ok
}

// release ends the VM's flows; it takes no new ones.
func (v *vmState) release() {
	v.mu.Lock()
	v.gone = true
	cs := make([]io.Closer, 0, len(v.flows))
	for _, c := range v.flows {
		if c != nil {
			cs = append(cs, c)
		}
	}
	v.pins = map[pinKey]time.Time{}
	v.mu.Unlock()
	for _, c := range cs {
		_ = c.Close()
	}
}

// pin allows ip for the domain rules until the given time. It fails when the
// VM already has maxPinsPerVM live pins.
func (v *vmState) pin(rules []int, ips []netip.Addr, now time.Time) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	if len(v.pins)+len(rules)*len(ips) > maxPinsPerVM {
		maps.DeleteFunc(v.pins, func(_ pinKey, until time.Time) bool { return !until.After(now) })
	}
	fresh := 0
	for _, r := range rules {
		for _, ip := range ips {
			if _, ok := v.pins[pinKey{r, ip}]; !ok {
				fresh++
			}
		}
	}
	if len(v.pins)+fresh > maxPinsPerVM {
		return false
	}
	for _, r := range rules {
		for _, ip := range ips {
			v.pins[pinKey{r, ip}] = now.Add(pinTTL + pinGrace)
		}
	}
	return true
}

func (v *vmState) pinned(rule int, ip netip.Addr, now time.Time) bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	until, ok := v.pins[pinKey{rule, ip}]
	return ok && now.Before(until)
}

// VMStats are one VM's network counters; only Release resets them.
type VMStats struct {
	Dropped         uint64            // frames the anti-spoofing filter dropped
	EgressDropped   map[string]uint64 // packets the egress policy dropped, by reason
	NATTCPFlows     int               // open NAT flows
	NATUDPFlows     int               //
	NATRefused      map[string]uint64 // new NAT flows refused, by reason
	DNSRefused      map[string]uint64 // lookups refused, by reason
	IMDSConnections int               // open IMDS connections
	IMDSRefused     uint64            // IMDS connections over the bound, closed at once
	IMDSTimedOut    uint64            // IMDS connections closed by the read timeout
}

// EgressDroppedTotal is the sum over the reasons.
func (s VMStats) EgressDroppedTotal() uint64 {
	var t uint64
	for _, v := range s.EgressDropped {
		t += v
	}
	return t
}

func (v *vmState) stats() VMStats {
	s := VMStats{
		Dropped:       v.dropped.Load(),
		EgressDropped: map[string]uint64{}, NATRefused: map[string]uint64{}, DNSRefused: map[string]uint64{},
		IMDSConnections: int(v.imdsConns.Load()),
		IMDSRefused:     v.imdsRefused.Load(),
		IMDSTimedOut:    v.imdsTimedOut.Load(),
	}
	for i := range v.egress {
		s.EgressDropped[egressNames[i]] = v.egress[i].Load()
	}
	for i := range v.nat {
		s.NATRefused[natNames[i]] = v.nat[i].Load()
	}
	for i := range v.dns {
		s.DNSRefused[dnsNames[i]] = v.dns[i].Load()
	}
	v.mu.Lock()
	s.NATTCPFlows, s.NATUDPFlows = v.tcp, v.udp
	v.mu.Unlock()
	return s
}
