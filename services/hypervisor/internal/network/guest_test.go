package network

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"io"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"gvisor.dev/gvisor/pkg/buffer"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/link/channel"
	"gvisor.dev/gvisor/pkg/tcpip/link/ethernet"
	"gvisor.dev/gvisor/pkg/tcpip/network/arp"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"
)

// fakeGuest stands in for a guest kernel behind QEMU: it speaks the QEMU
// stream framing (4-byte big-endian length per Ethernet frame) on a
// connection, does DHCP and ARP with raw frames and can run its own gVisor
// stack for TCP.
type fakeGuest struct {
	t    *testing.T
	conn net.Conn
	r    *bufio.Reader
	wmu  sync.Mutex
	mac  net.HardwareAddr
	// stack is the guest's gVisor stack once startStack ran.
	stack *stack.Stack
}

func newGuest(t *testing.T, conn net.Conn, mac string) *fakeGuest {
	t.Helper()
	hw, err := net.ParseMAC(mac)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return &fakeGuest{t: t, conn: conn, r: bufio.NewReader(conn), mac: hw}
}

// fakeQEMU plays QEMU's side of "-netdev stream,server=on": it listens on a
// unix socket and Attach dials it.
type fakeQEMU struct {
	t      *testing.T
	sock   string
	ln     *net.UnixListener
	cancel context.CancelFunc
	done   chan error // Attach's result
}

// newQEMU returns a fake QEMU whose socket path is chosen but not listened on yet.
func newQEMU(t *testing.T) *fakeQEMU {
	t.Helper()
	return &fakeQEMU{t: t, sock: filepath.Join(t.TempDir(), "net.sock"), done: make(chan error, 1)}
}

// listenQEMU returns a fake QEMU listening on its socket.
func listenQEMU(t *testing.T) *fakeQEMU {
	t.Helper()
	q := newQEMU(t)
	q.listen()
	return q
}

func (q *fakeQEMU) listen() {
	q.t.Helper()
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: q.sock, Net: "unix"})
	if err != nil {
		q.t.Fatal(err)
	}
	q.ln = ln
	q.t.Cleanup(func() { _ = ln.Close() })
}

// attach runs n.Attach for vmID in the background; the test's cleanup
// cancels it and waits for it.
func (q *fakeQEMU) attach(n *Network, vmID string) {
	ctx, cancel := context.WithCancel(context.Background())
	q.cancel = cancel
	go func() { q.done <- n.Attach(ctx, vmID, q.sock) }()
	q.t.Cleanup(func() {
		cancel()
		select {
		case <-q.done:
		case <-time.After(10 * time.Second):
			q.t.Error("Attach did not return after cleanup")
		}
	})
}

// accept waits for the network to dial in and returns the guest's end.
func (q *fakeQEMU) accept(mac string) *fakeGuest {
	q.t.Helper()
	_ = q.ln.SetDeadline(time.Now().Add(10 * time.Second))
	conn, err := q.ln.Accept()
	if err != nil {
		q.t.Fatalf("the network did not dial %s: %v", q.sock, err)
	}
	return newGuest(q.t, conn, mac)
}

// result waits for Attach to return.
func (q *fakeQEMU) result(timeout time.Duration) error {
	q.t.Helper()
	select {
	case err := <-q.done:
		q.done <- err // for the cleanup
		return err
	case <-time.After(timeout):
		q.t.Fatalf("Attach did not return within %v", timeout)
		return nil
	}
}

// attachGuest attaches vmID (which must hold a lease) through a fake QEMU.
func attachGuest(t *testing.T, n *Network, vmID string) (*fakeGuest, *fakeQEMU) {
	t.Helper()
	ip, ok := n.Leases()[vmID]
	if !ok {
		t.Fatalf("%s has no lease", vmID)
	}
	q := listenQEMU(t)
	q.attach(n, vmID)
	return q.accept(MAC(n.Name(), ip)), q
}

func (g *fakeGuest) writeFrame(b []byte) error {
	g.wmu.Lock()
	defer g.wmu.Unlock()
	buf := make([]byte, 4+len(b))
	binary.BigEndian.PutUint32(buf, uint32(len(b)))
	copy(buf[4:], b)
	_, err := g.conn.Write(buf)
	return err
}

func (g *fakeGuest) readFrame() ([]byte, error) {
	var l [4]byte
	if _, err := io.ReadFull(g.r, l[:]); err != nil {
		return nil, err
	}
	b := make([]byte, binary.BigEndian.Uint32(l[:]))
	_, err := io.ReadFull(g.r, b)
	return b, err
}

// udpFrame builds Ethernet/IPv4/UDP around payload (UDP checksum 0: none).
func udpFrame(src, dst tcpip.LinkAddress, srcIP, dstIP tcpip.Address, sport, dport uint16, payload []byte) []byte {
	const ipOff, udpOff = header.EthernetMinimumSize, header.EthernetMinimumSize + header.IPv4MinimumSize
	b := make([]byte, udpOff+header.UDPMinimumSize+len(payload))
	header.Ethernet(b).Encode(&header.EthernetFields{SrcAddr: src, DstAddr: dst, Type: header.IPv4ProtocolNumber})
	ip := header.IPv4(b[ipOff:])
	ip.Encode(&header.IPv4Fields{
		TotalLength: uint16(header.IPv4MinimumSize + header.UDPMinimumSize + len(payload)),
		TTL:         64,
		Protocol:    uint8(header.UDPProtocolNumber),
		SrcAddr:     srcIP,
		DstAddr:     dstIP,
	})
	ip.SetChecksum(^ip.CalculateChecksum())
	header.UDP(b[udpOff:]).Encode(&header.UDPFields{SrcPort: sport, DstPort: dport, Length: uint16(header.UDPMinimumSize + len(payload))})
	copy(b[udpOff+header.UDPMinimumSize:], payload)
	return b
}

// dhcpExchange sends msg and waits for a DHCP reply with its transaction id.
func (g *fakeGuest) dhcpExchange(msg *dhcpv4.DHCPv4, want dhcpv4.MessageType, timeout time.Duration) (*dhcpv4.DHCPv4, error) {
	frame := udpFrame(tcpip.LinkAddress(g.mac), header.EthernetBroadcastAddress,
		header.IPv4Any, header.IPv4Broadcast, dhcpv4.ClientPort, dhcpv4.ServerPort, msg.ToBytes())
	if err := g.writeFrame(frame); err != nil {
		return nil, err
	}
	_ = g.conn.SetReadDeadline(time.Now().Add(timeout))
	defer func() { _ = g.conn.SetReadDeadline(time.Time{}) }()
	for {
		f, err := g.readFrame()
		if err != nil {
			return nil, fmt.Errorf("waiting for DHCP %s: %w", want, err)
		}
		eth := header.Ethernet(f)
		if len(f) < header.EthernetMinimumSize || eth.Type() != header.IPv4ProtocolNumber {
			continue
		}
		ip := header.IPv4(f[header.EthernetMinimumSize:])
		if !ip.IsValid(len(ip)) || ip.TransportProtocol() != header.UDPProtocolNumber {
			continue
		}
		udp := header.UDP(ip.Payload())
		if len(udp) < header.UDPMinimumSize || udp.DestinationPort() != dhcpv4.ClientPort {
			continue
		}
		reply, err := dhcpv4.FromBytes(udp.Payload())
		if err != nil || reply.TransactionID != msg.TransactionID {
			continue
		}
		if reply.MessageType() != want {
			return nil, fmt.Errorf("got DHCP %s, want %s", reply.MessageType(), want)
		}
		return reply, nil
	}
}

// dhcp runs DISCOVER/OFFER/REQUEST/ACK and returns the ACK.
func (g *fakeGuest) dhcp() (*dhcpv4.DHCPv4, error) {
	disc, err := dhcpv4.NewDiscovery(g.mac, dhcpv4.WithBroadcast(true))
	if err != nil {
		return nil, err
	}
	offer, err := g.dhcpExchange(disc, dhcpv4.MessageTypeOffer, 5*time.Second)
	if err != nil {
		return nil, err
	}
	req, err := dhcpv4.NewRequestFromOffer(offer, dhcpv4.WithBroadcast(true))
	if err != nil {
		return nil, err
	}
	return g.dhcpExchange(req, dhcpv4.MessageTypeAck, 5*time.Second)
}

// startStack brings up a gVisor stack on the connection with a static
// address and a default route through gw, and returns an HTTP client that
// dials through it.
func (g *fakeGuest) startStack(ctx context.Context, addr netip.Prefix, gw netip.Addr) *http.Client {
	t := g.t
	ch := channel.New(256, MTU+header.EthernetMinimumSize, tcpip.LinkAddress(g.mac))
	s := stack.New(stack.Options{
		NetworkProtocols:   []stack.NetworkProtocolFactory{ipv4.NewProtocol, arp.NewProtocol},
		TransportProtocols: []stack.TransportProtocolFactory{tcp.NewProtocol, udp.NewProtocol},
	})
	g.stack = s
	t.Cleanup(func() { ch.Close(); s.Close() })
	if err := s.CreateNIC(1, ethernet.New(ch)); err != nil {
		t.Fatalf("CreateNIC: %v", err)
	}
	if err := s.AddProtocolAddress(1, tcpip.ProtocolAddress{
		Protocol:          ipv4.ProtocolNumber,
		AddressWithPrefix: tcpip.AddressWithPrefix{Address: tcpip.AddrFrom4(addr.Addr().As4()), PrefixLen: addr.Bits()},
	}, stack.AddressProperties{}); err != nil {
		t.Fatalf("AddProtocolAddress: %v", err)
	}
	s.SetRouteTable([]tcpip.Route{{Destination: header.IPv4EmptySubnet, Gateway: tcpip.AddrFrom4(gw.As4()), NIC: 1}})

	go func() { // stack -> socket
		for {
			pkt := ch.ReadContext(ctx)
			if pkt == nil {
				return
			}
			b := pkt.ToView().AsSlice()
			err := g.writeFrame(b)
			pkt.DecRef()
			if err != nil {
				return
			}
		}
	}()
	go func() { // socket -> stack
		for {
			f, err := g.readFrame()
			if err != nil {
				return
			}
			pkt := stack.NewPacketBuffer(stack.PacketBufferOptions{Payload: buffer.MakeWithData(f)})
			ch.InjectInbound(0, pkt)
			pkt.DecRef()
		}
	}()
	return &http.Client{
		Timeout: 10 * time.Second,
		Transport: &http.Transport{
			DisableKeepAlives: true,
			DialContext: func(ctx context.Context, _, address string) (net.Conn, error) {
				ap, err := netip.ParseAddrPort(address)
				if err != nil {
					return nil, err
				}
				return gonet.DialContextTCP(ctx, s, tcpip.FullAddress{NIC: 1, Addr: tcpip.AddrFrom4(ap.Addr().As4()), Port: ap.Port()}, ipv4.ProtocolNumber)
			},
		},
	}
}

// recorder is an IMDS handler that records the peer of each request.
type recorder struct {
	name string
	mu   sync.Mutex
	seen []string
}

func (h *recorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h.mu.Lock()
	h.seen = append(h.seen, r.RemoteAddr+" "+r.URL.Path)
	h.mu.Unlock()
	fmt.Fprintf(w, "%s %s", h.name, r.RemoteAddr)
}

func (h *recorder) requests() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.seen...)
}

func get(t *testing.T, c *http.Client, url string) string {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", url, resp.Status)
	}
	return string(b)
}

func TestGuestDHCPAndIMDS(t *testing.T) {
	imdsA := &recorder{name: "A"}
	imdsB := &recorder{name: "B"}
	// Two networks with the same CIDR: they must not see each other.
	a := startTest(t, Spec{Name: "alpha", CIDR: "10.77.0.0/24", DNSSearchDomain: "alpha.internal"}, nil, imdsA)
	b := startTest(t, Spec{Name: "beta", CIDR: "10.77.0.0/24"}, nil, imdsB)

	mustAllocate(t, a, "vm-0") // 10.77.0.2, so the guest under test is not at the first address
	ip, mac, err := a.Allocate("vm-1")
	if err != nil {
		t.Fatal(err)
	}
	if ip.String() != "10.77.0.3" {
		t.Fatalf("allocated %s", ip)
	}
	mustAllocate(t, b, "other") // 10.77.0.2 on beta

	g, q := attachGuest(t, a, "vm-1")
	if g.mac.String() != mac {
		t.Fatalf("guest MAC %s, Allocate said %s", g.mac, mac)
	}
	start := time.Now()
	ack, err := g.dhcp()
	if err != nil {
		t.Fatalf("DHCP: %v", err)
	}
	t.Logf("DHCP took %v", time.Since(start))
	if got := ack.YourIPAddr.String(); got != ip.String() {
		t.Fatalf("DHCP gave %s, want %s", got, ip)
	}
	if r := ack.Router(); len(r) != 1 || r[0].String() != "10.77.0.1" {
		t.Fatalf("router %v", r)
	}
	if m := net.IP(ack.SubnetMask()).String(); m != "255.255.255.0" {
		t.Fatalf("mask %s", m)
	}
	if d := ack.DNS(); len(d) != 1 || d[0].String() != "10.77.0.1" {
		t.Fatalf("dns %v", d)
	}
	if sl := ack.DomainSearch(); sl == nil || len(sl.Labels) != 1 || sl.Labels[0] != "alpha.internal" {
		t.Fatalf("search list %v", sl)
	}
	if ack.ServerIdentifier().String() != "10.77.0.1" {
		t.Fatalf("server id %s", ack.ServerIdentifier())
	}

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	client := g.startStack(ctx, netip.PrefixFrom(netip.MustParseAddr(ack.YourIPAddr.String()), 24), netip.MustParseAddr("10.77.0.1"))
	start = time.Now()
	body := get(t, client, "http://169.254.169.254/x")
	t.Logf("IMDS request took %v", time.Since(start))
	host, _, err := net.SplitHostPort(body[2:])
	if err != nil || body[:2] != "A " || host != ip.String() {
		t.Fatalf("IMDS answered %q, want A from %s", body, ip)
	}
	reqs := imdsA.requests()
	if len(reqs) != 1 {
		t.Fatalf("IMDS A requests %v", reqs)
	}
	if h, _, _ := net.SplitHostPort(reqs[0][:len(reqs[0])-len(" /x")]); h != ip.String() {
		t.Fatalf("IMDS saw RemoteAddr %q, want %s", reqs[0], ip)
	}
	if len(imdsB.requests()) != 0 {
		t.Fatalf("IMDS of the other network saw %v", imdsB.requests())
	}
	if st := a.Stats(); st.Attachments != 1 || st.BytesFromVMs == 0 || st.BytesToVMs == 0 || st.Dropped != 0 {
		t.Fatalf("stats %+v", st)
	}
	if st := b.Stats(); st.Attachments != 0 || st.BytesFromVMs != 0 {
		t.Fatalf("stats of the other network %+v", st)
	}

	// The host alias is not translated to the host's loopback: a service on
	// 127.0.0.1 must not be reachable through 10.77.0.254.
	hostLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer hostLn.Close()
	accepted := make(chan string, 1)
	go func() {
		if c, err := hostLn.Accept(); err == nil {
			accepted <- c.RemoteAddr().String()
			c.Close()
		}
	}()
	port := hostLn.Addr().(*net.TCPAddr).Port
	dctx, dcancel := context.WithTimeout(ctx, 3*time.Second)
	defer dcancel()
	if c, err := client.Transport.(*http.Transport).DialContext(dctx, "tcp", fmt.Sprintf("10.77.0.254:%d", port)); err == nil {
		c.Close()
		t.Fatalf("host alias 10.77.0.254:%d is reachable", port)
	}
	// The NAT would have dialed the listener before answering the guest: a
	// connection of ours made now queues behind any it made, and the first
	// one accepted says which came first.
	probe, err := net.Dial("tcp", hostLn.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer probe.Close()
	select {
	case from := <-accepted:
		if from != probe.LocalAddr().String() {
			t.Fatalf("host loopback listener was reached through the network (from %s)", from)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the probe connection was not accepted")
	}

	// Closing the network disconnects the guest and ends Attach.
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := q.result(5 * time.Second); err != nil {
		t.Fatalf("Attach after Close: %v", err)
	}
	_ = g.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	_, err = io.Copy(io.Discard, g.r)
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatal("guest connection still open after Close")
	}
	if st := a.Stats(); st.Attachments != 0 {
		t.Fatalf("stats after Close %+v", st)
	}
}

func TestGuestUnknownMACGetsNoLease(t *testing.T) {
	n := startTest(t, Spec{Name: "gamma", CIDR: "10.66.0.0/29"}, nil, nil)
	// Straight to the switch, past Attach's filter: a MAC derived for
	// another network is not registered here, and every address is
	// pre-registered, so the DHCP server has nothing to offer.
	c1, c2 := net.Pipe()
	go func() { _ = n.us.accept(t.Context(), c1) }()
	g := newGuest(t, c2, MAC("delta", netip.MustParseAddr("10.66.0.10")))
	disc, err := dhcpv4.NewDiscovery(g.mac, dhcpv4.WithBroadcast(true))
	if err != nil {
		t.Fatal(err)
	}
	if reply, err := g.dhcpExchange(disc, dhcpv4.MessageTypeOffer, time.Second); err == nil {
		t.Fatalf("unknown MAC was offered %s", reply.YourIPAddr)
	}
}

// A guest that asks DHCP for another VM's address with that VM's MAC gets
// nothing: the frame never leaves its connection.
func TestGuestSpoofedMACGetsNoLease(t *testing.T) {
	n := startTest(t, Spec{Name: "epsilon", CIDR: "10.65.0.0/29"}, nil, nil)
	mustAllocate(t, n, "mallory")
	victim := mustAllocate(t, n, "victim")
	g, _ := attachGuest(t, n, "mallory")
	g.mac, _ = net.ParseMAC(MAC(n.Name(), victim))
	disc, err := dhcpv4.NewDiscovery(g.mac, dhcpv4.WithBroadcast(true))
	if err != nil {
		t.Fatal(err)
	}
	if reply, err := g.dhcpExchange(disc, dhcpv4.MessageTypeOffer, 2*time.Second); err == nil {
		t.Fatalf("spoofed MAC was offered %s", reply.YourIPAddr)
	}
	poll.Until(t, "drop counted", func() bool { return n.Dropped("mallory") == 1 })
	if d := n.Dropped("victim"); d != 0 {
		t.Fatalf("victim's drops %d", d)
	}
}
