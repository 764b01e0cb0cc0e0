package network

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"sort"
	"sync"
	"sync/atomic"

	"github.com/containers/gvisor-tap-vsock/pkg/types"
	"github.com/giantswarm/vm-manager/sdk/apierr"
)

const (
	// MTU of every network.
	MTU = 1500
	// GatewayMAC is the MAC of the gateway in every network. Guest MACs all
	// start with 02:, so they never collide with it.
	GatewayMAC = "5a:94:ef:e4:0c:ee"
	// MaxSocketPath is the longest unix socket path (sun_path is 108 bytes
	// including the terminating NUL).
	MaxSocketPath = 107

	// reservedMAC owns the DHCP leases of the host alias and the broadcast
	// address so they can never be handed out. It is the broadcast MAC, which
	// no guest can use as its source address.
	reservedMAC = "ff:ff:ff:ff:ff:ff"
	imdsPort    = 80
	dnsPort     = 53
)

// Network is one running userspace network.
type Network struct {
	spec   Spec
	plan   Plan
	limits Limits
	log    *slog.Logger
	us     *userspace
	dns    *dnsServer

	imdsSrv *http.Server
	runCtx  context.Context // done when the network is closed
	cancel  context.CancelFunc
	stop    func() bool    // detaches the parent-context watcher
	wg      sync.WaitGroup // IMDS and DNS servers, Attach loops

	toVMs, fromVMs atomic.Uint64 // bytes on the QEMU sockets, frame lengths included
	dropped        atomic.Uint64 // frames from VMs the anti-spoofing filter dropped
	egressDropped  atomic.Uint64 // packets from VMs the egress policy dropped
	egress         egressPolicy

	mu     sync.Mutex
	closed bool
	leases map[string]netip.Addr // vmID -> IP
	conns  map[net.Conn]string   // open QEMU connections -> vmID
	vms    map[string]*vmState   // vmID -> its accounting, until Release
	// byIP indexes vms by lease for the packet path; replaced, never
	// changed, under mu.
	byIP atomic.Pointer[map[netip.Addr]*vmState]
}

// Start creates the network described by spec and serves imds (if not nil)
// on 169.254.169.254:80 inside the network. VMs are connected with Attach.
//
// leases are the restored vmID -> IP leases. A restored lease that is outside
// the pool or whose IP is already held by another VM (checked in vmID order)
// is dropped with a warning.
//
// The network runs until Close is called or ctx is cancelled.
func Start(ctx context.Context, spec Spec, leases map[string]netip.Addr, imds http.Handler, limits Limits, log *slog.Logger) (*Network, error) {
	if err := Validate(spec); err != nil {
		return nil, err
	}
	plan, err := PlanFor(spec.CIDR)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("network", spec.Name)

	n := &Network{
		spec:   spec,
		plan:   plan,
		limits: limits.withDefaults(),
		log:    log,
		leases: make(map[string]netip.Addr, len(leases)),
		conns:  make(map[net.Conn]string),
		vms:    make(map[string]*vmState),
		egress: egressPolicy{plan: plan, rules: spec.Egress},
	}
	n.restore(leases)
	n.runCtx, n.cancel = context.WithCancel(context.WithoutCancel(ctx))

	us, err := newUserspace(n.configuration())
	if err != nil {
		n.cancel()
		return nil, apierr.Errorf(apierr.Internal, "network %s: create virtual network: %w", spec.Name, err)
	}
	n.us = us
	n.startNAT()
	if err := n.startDNS(spec.DNSRecords, spec.DNSPolicy); err != nil {
		n.cancel()
		return nil, apierr.Errorf(apierr.Internal, "network %s: DNS: %w", spec.Name, err)
	}
	if imds != nil {
		if err := n.serveIMDS(imds); err != nil {
			n.dns.close()
			n.cancel()
			return nil, apierr.Errorf(apierr.Internal, "network %s: listen on IMDS address: %w", spec.Name, err)
		}
	}
	n.stop = context.AfterFunc(ctx, func() { _ = n.Close() })
	log.Info("network started", "cidr", plan.Prefix.String(), "leases", len(n.leases), "imds", imds != nil)
	return n, nil
}

// configuration builds the gvisor-tap-vsock configuration. The library has
// no way to add DHCP static leases after creation (its IP pool is private),
// so every pool address is registered with its derived MAC up front; the
// host alias and the broadcast address are registered too so that nobody can
// ever lease them, and an unknown MAC gets no address at all.
func (n *Network) configuration() *types.Configuration {
	static := make(map[string]string, n.plan.PoolSize()+2)
	for ip := n.plan.PoolFirst; ip.Compare(n.plan.PoolLast) <= 0; ip = ip.Next() {
		static[ip.String()] = MAC(n.spec.Name, ip)
	}
	static[n.plan.HostAlias.String()] = reservedMAC
	static[n.plan.Broadcast.String()] = reservedMAC
	var search []string
	if n.spec.DNSSearchDomain != "" {
		search = []string{n.spec.DNSSearchDomain}
	}
	return &types.Configuration{
		MTU:               MTU,
		Subnet:            n.plan.Prefix.String(),
		GatewayIP:         n.plan.Gateway.String(),
		GatewayMacAddress: GatewayMAC,
		DNSSearchDomains:  search,
		// No virtual IP for the host alias: it is opt-in (enableHostAlias)
		// and off for every API-created network, so nothing answers ARP for
		// it, and the egress filter drops what is sent to it anyway.
		GatewayVirtualIPs: []string{IMDSAddr.String()},
		DHCPStaticLeases:  static,
		Protocol:          types.QemuProtocol,
	}
}

func (n *Network) restore(leases map[string]netip.Addr) {
	ids := make([]string, 0, len(leases))
	for id := range leases {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	held := make(map[netip.Addr]string, len(leases))
	for _, id := range ids {
		ip := leases[id].Unmap()
		switch {
		case id == "":
			n.log.Warn("dropping restored lease without a VM id", "ip", ip)
		case !n.plan.InPool(ip):
			n.log.Warn("dropping restored lease outside the pool", "vm", id, "ip", ip)
		case held[ip] != "":
			n.log.Warn("dropping restored lease held twice", "vm", id, "ip", ip, "holder", held[ip])
		default:
			held[ip] = id
			n.leases[id] = ip
			n.vms[id] = newVMState(id, ip)
		}
	}
	n.reindexLocked()
}

// reindexLocked rebuilds byIP from vms; n.mu is held (or n is not shared yet).
func (n *Network) reindexLocked() {
	m := make(map[netip.Addr]*vmState, len(n.vms))
	for _, v := range n.vms {
		m[v.ip] = v
	}
	n.byIP.Store(&m)
}

// vmAt is the VM holding ip, nil if none.
func (n *Network) vmAt(ip netip.Addr) *vmState {
	if m := n.byIP.Load(); m != nil {
		return (*m)[ip]
	}
	return nil
}

func (n *Network) isLease(ip netip.Addr) bool { return n.vmAt(ip) != nil }

// Name returns the network name.
func (n *Network) Name() string { return n.spec.Name }

// Plan returns the address plan.
func (n *Network) Plan() Plan { return n.plan }

// Allocate returns the lease of vmID, creating one at the lowest free pool
// address if it has none, and the MAC the VM must use. A full pool or a
// closed network is an apierr conflict.
func (n *Network) Allocate(vmID string) (netip.Addr, string, error) {
	if vmID == "" {
		return netip.Addr{}, "", apierr.Invalidf("vmId", "empty VM id")
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return netip.Addr{}, "", apierr.Errorf(apierr.Conflict, "network %s is closed", n.spec.Name)
	}
	if ip, ok := n.leases[vmID]; ok {
		return ip, MAC(n.spec.Name, ip), nil
	}
	used := make(map[netip.Addr]struct{}, len(n.leases))
	for _, ip := range n.leases {
		used[ip] = struct{}{}
	}
	for ip := n.plan.PoolFirst; ip.Compare(n.plan.PoolLast) <= 0; ip = ip.Next() {
		if _, ok := used[ip]; !ok {
			n.leases[vmID] = ip
			n.vms[vmID] = newVMState(vmID, ip)
			n.reindexLocked()
			return ip, MAC(n.spec.Name, ip), nil
		}
	}
	return netip.Addr{}, "", apierr.Errorf(apierr.Conflict, "network %s: address pool %s is exhausted (%d addresses)", n.spec.Name, n.plan.Prefix, n.plan.PoolSize())
}

// Release frees the lease of vmID, if any, resets its counters, ends its NAT
// flows and disconnects its QEMU connection, if attached (the address may go
// to another VM at once). An Attach of vmID then returns a conflict error.
func (n *Network) Release(vmID string) {
	n.mu.Lock()
	delete(n.leases, vmID)
	vs := n.vms[vmID]
	delete(n.vms, vmID)
	n.reindexLocked()
	var conns []net.Conn
	for c, id := range n.conns {
		if id == vmID {
			conns = append(conns, c)
		}
	}
	n.mu.Unlock()
	for _, c := range conns {
		_ = c.Close()
	}
	if vs != nil {
		vs.release()
	}
}

// Leases returns a copy of the vmID -> IP leases.
func (n *Network) Leases() map[string]netip.Addr {
	n.mu.Lock()
	defer n.mu.Unlock()
	out := make(map[string]netip.Addr, len(n.leases))
	for k, v := range n.leases {
		out[k] = v
	}
	return out
}

// DialContextTCP dials addr ("ip:port") from the gateway into the network
// (for port forwards and exec).
func (n *Network) DialContextTCP(ctx context.Context, addr string) (net.Conn, error) {
	n.mu.Lock()
	closed := n.closed
	n.mu.Unlock()
	if closed {
		return nil, apierr.Errorf(apierr.Conflict, "network %s is closed", n.spec.Name)
	}
	ap, err := netip.ParseAddrPort(addr)
	if err != nil || !ap.Addr().Is4() {
		return nil, apierr.Invalidf("address", "%q is not an IPv4 address and port", addr)
	}
	return n.us.dialTCP(ctx, ap)
}

// Stats are the traffic counters of a network.
type Stats struct {
	Attachments   int    // open QEMU connections
	BytesToVMs    uint64 // bytes written to QEMU sockets, 4-byte frame lengths included
	BytesFromVMs  uint64 // bytes read from QEMU sockets, 4-byte frame lengths included (dropped frames too)
	Dropped       uint64 // frames from VMs dropped by the anti-spoofing filter
	EgressDropped uint64 // packets from VMs dropped by the egress policy
}

// Stats returns the current counters. (The library's own BytesSent and
// BytesReceived are read without synchronisation, so the sockets are counted
// here instead.)
func (n *Network) Stats() Stats {
	n.mu.Lock()
	a := len(n.conns)
	n.mu.Unlock()
	return Stats{Attachments: a, BytesToVMs: n.toVMs.Load(), BytesFromVMs: n.fromVMs.Load(), Dropped: n.dropped.Load(), EgressDropped: n.egressDropped.Load()}
}

// VMStats returns vmID's counters (zero without a lease). They survive
// reconnects; only Release resets them.
func (n *Network) VMStats(vmID string) VMStats {
	n.mu.Lock()
	vs := n.vms[vmID]
	n.mu.Unlock()
	if vs == nil {
		return newVMState(vmID, netip.Addr{}).stats()
	}
	return vs.stats()
}

// EgressDropped returns the number of packets from vmID that the egress
// policy dropped, whatever the reason.
func (n *Network) EgressDropped(vmID string) uint64 { return n.VMStats(vmID).EgressDroppedTotal() }

// Dropped returns the number of frames from vmID that the anti-spoofing
// filter dropped.
func (n *Network) Dropped(vmID string) uint64 { return n.VMStats(vmID).Dropped }

// Close disconnects the attached VMs (their Attach calls return nil), ends
// their NAT flows, stops the IMDS and DNS servers and waits for them. Leases
// are kept (Leases still works)
// but Allocate and Attach fail. gVisor stacks cannot be stopped, so some of
// the library's goroutines linger. Close is idempotent.
func (n *Network) Close() error {
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return nil
	}
	n.closed = true
	conns := make([]net.Conn, 0, len(n.conns))
	for c := range n.conns {
		conns = append(conns, c)
	}
	n.mu.Unlock()

	n.stop()
	n.cancel()
	var errs []error
	for _, c := range conns {
		_ = c.Close()
	}
	n.mu.Lock()
	for _, vs := range n.vms {
		vs.release()
	}
	n.mu.Unlock()
	n.dns.close()
	if n.imdsSrv != nil {
		if err := n.imdsSrv.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	n.wg.Wait()
	n.log.Info("network closed")
	return errors.Join(errs...)
}
