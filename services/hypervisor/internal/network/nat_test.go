package network

import (
	"context"
	"errors"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
)

// hostAddr is this machine's first non-loopback IPv4 address: the NAT tests
// send only to it (the NAT never reaches loopback). Skips without one.
func hostAddr(t *testing.T) netip.Addr {
	t.Helper()
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(ipn.IP.To4()); ok && !ip.IsLoopback() && !ip.IsLinkLocalUnicast() {
				return ip
			}
		}
	}
	t.Skip("no non-loopback IPv4 address on this host")
	return netip.Addr{}
}

// guestOn gives vmID a lease on n, attaches it and starts its stack with a
// default route through the gateway.
func guestOn(t *testing.T, n *Network, vmID string) (*fakeGuest, netip.Addr) {
	t.Helper()
	ip := mustAllocate(t, n, vmID)
	g, _ := attachGuest(t, n, vmID)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	g.startStack(ctx, netip.PrefixFrom(ip, n.plan.Prefix.Bits()), n.plan.Gateway)
	return g, ip
}

func (g *fakeGuest) dialUDP(dst netip.AddrPort) *gonet.UDPConn {
	g.t.Helper()
	c, err := gonet.DialUDP(g.stack, nil, &tcpip.FullAddress{NIC: 1, Addr: tcpip.AddrFrom4(dst.Addr().As4()), Port: dst.Port()}, ipv4.ProtocolNumber)
	if err != nil {
		g.t.Fatal(err)
	}
	g.t.Cleanup(func() { c.Close() })
	return c
}

func (g *fakeGuest) dialTCP(dst netip.AddrPort, timeout time.Duration) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return gonet.DialContextTCP(ctx, g.stack, tcpip.FullAddress{NIC: 1, Addr: tcpip.AddrFrom4(dst.Addr().As4()), Port: dst.Port()}, ipv4.ProtocolNumber)
}

// echoes reports whether a datagram on c comes back within d.
func echoes(c *gonet.UDPConn, d time.Duration) bool {
	if _, err := c.Write([]byte("ping")); err != nil {
		return false
	}
	_ = c.SetReadDeadline(time.Now().Add(d))
	buf := make([]byte, 64)
	k, err := c.Read(buf)
	return err == nil && string(buf[:k]) == "ping"
}

// hostServers are a UDP echo and a TCP server that holds connections open
// on ip, both on one port.
type hostServers struct {
	addr     netip.AddrPort
	accepted atomic.Int32
	mu       sync.Mutex
	conns    []net.Conn
}

func serveHost(t *testing.T, ip netip.Addr) *hostServers {
	t.Helper()
	ln, err := net.Listen("tcp", netip.AddrPortFrom(ip, 0).String())
	if err != nil {
		t.Fatal(err)
	}
	h := &hostServers{addr: netip.MustParseAddrPort(ln.Addr().String())}
	pc, err := net.ListenPacket("udp", h.addr.String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ln.Close()
		pc.Close()
		h.mu.Lock()
		for _, c := range h.conns {
			c.Close()
		}
		h.mu.Unlock()
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			h.accepted.Add(1)
			h.mu.Lock()
			h.conns = append(h.conns, c)
			h.mu.Unlock()
		}
	}()
	go func() {
		buf := make([]byte, 2048)
		for {
			k, from, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			_, _ = pc.WriteTo(buf[:k], from)
		}
	}()
	return h
}

// A VM's NAT flows are bounded per protocol; over the bound new flows are
// refused and counted, the other VM's flows are not affected, idle UDP
// flows end, and a released VM's flows are closed.
func TestNATBoundsPerVM(t *testing.T) {
	ip := hostAddr(t)
	h := serveHost(t, ip)
	host := NewFlowBudget(100)
	n, err := Start(t.Context(), Spec{Name: "nat", CIDR: "10.80.0.0/24", Egress: mustRules(t, RuleSpec{CIDR: netip.PrefixFrom(ip, 32).String()})},
		nil, nil, Limits{NATTCPPerVM: 3, NATUDPPerVM: 5, NATUDPIdle: 3 * time.Second, Host: host}, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Close() })
	a, _ := guestOn(t, n, "a")
	b, _ := guestOn(t, n, "b")

	// UDP: ten sockets of a, five flows (a refused datagram is not
	// answered; the flows are young enough not to end meanwhile).
	answered := 0
	for range 10 {
		if echoes(a.dialUDP(h.addr), 300*time.Millisecond) {
			answered++
		}
	}
	st := n.VMStats("a")
	if answered != 5 || st.NATUDPFlows != 5 || st.NATRefused["udp_vm_limit"] == 0 {
		t.Fatalf("a: %d of 10 UDP sockets answered, stats %+v; want 5 flows and refusals", answered, st)
	}
	if !echoes(b.dialUDP(h.addr), 2*time.Second) {
		t.Fatal("b's UDP flow was refused while a was at its bound")
	}
	if st := n.VMStats("b"); st.NATUDPFlows != 1 || st.NATRefused["udp_vm_limit"] != 0 {
		t.Fatalf("b: %+v", st)
	}
	if host.Used() != 6 {
		t.Fatalf("host budget used %d, want 6", host.Used())
	}

	// TCP: three connections of a, the fourth is reset at once.
	for i := range 3 {
		if _, err := a.dialTCP(h.addr, 5*time.Second); err != nil {
			t.Fatalf("a's TCP connection %d: %v", i, err)
		}
	}
	start := time.Now()
	if c, err := a.dialTCP(h.addr, 5*time.Second); err == nil {
		c.Close()
		t.Fatal("a's fourth TCP connection was accepted")
	} else if time.Since(start) > 2*time.Second {
		t.Errorf("the refused connection took %v (want a reset, not a timeout): %v", time.Since(start), err)
	}
	if _, err := b.dialTCP(h.addr, 5*time.Second); err != nil {
		t.Fatalf("b's TCP connection while a is at its bound: %v", err)
	}
	poll.Until(t, "4 accepted", func() bool { return h.accepted.Load() == 4 })
	if st := n.VMStats("a"); st.NATTCPFlows != 3 || st.NATRefused["tcp_vm_limit"] != 1 {
		t.Fatalf("a after TCP: %+v", st)
	}

	// Idle UDP flows end after NATUDPIdle; the TCP ones stay.
	poll.Until(t, "idle UDP flows closed", func() bool { return n.VMStats("a").NATUDPFlows == 0 && n.VMStats("b").NATUDPFlows == 0 })
	if host.Used() != 4 {
		t.Fatalf("host budget used %d after the UDP flows ended, want 4", host.Used())
	}
	if !echoes(a.dialUDP(h.addr), 2*time.Second) {
		t.Fatal("a's UDP after its idle flows ended")
	}

	// Release ends a's flows: the host sees its three connections close.
	n.Release("a")
	poll.Until(t, "a's flows released", func() bool { return host.Used() == 1 })
	h.mu.Lock()
	conns := append([]net.Conn(nil), h.conns...)
	h.mu.Unlock()
	closed := 0
	for _, c := range conns {
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		if _, err := c.Read(make([]byte, 1)); err != nil && !errors.Is(err, context.DeadlineExceeded) {
			var ne net.Error
			if !errors.As(err, &ne) || !ne.Timeout() {
				closed++
			}
		}
	}
	if closed != 3 {
		t.Fatalf("%d host connections closed after Release, want a's 3", closed)
	}
}

// The host's bound holds across VMs and networks.
func TestNATHostBound(t *testing.T) {
	ip := hostAddr(t)
	h := serveHost(t, ip)
	host := NewFlowBudget(3)
	rules := mustRules(t, RuleSpec{CIDR: netip.PrefixFrom(ip, 32).String()})
	var gs []*fakeGuest
	var nets []*Network
	for _, name := range []string{"h1", "h2"} {
		n, err := Start(t.Context(), Spec{Name: name, CIDR: "10.81.0.0/24", Egress: rules}, nil, nil, Limits{Host: host}, testLogger(t))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = n.Close() })
		g, _ := guestOn(t, n, "vm-"+name)
		gs, nets = append(gs, g), append(nets, n)
	}
	ok := 0
	for i := range 6 {
		if echoes(gs[i%2].dialUDP(h.addr), 300*time.Millisecond) {
			ok++
		}
	}
	refused := nets[0].VMStats("vm-h1").NATRefused["udp_host_limit"] + nets[1].VMStats("vm-h2").NATRefused["udp_host_limit"]
	if ok != 3 || refused == 0 || host.Used() != 3 {
		t.Fatalf("%d flows answered, %d refused by the host bound, %d used; want 3, some, 3", ok, refused, host.Used())
	}
}
