package network

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/pkg/logging/logtest"
	"github.com/giantswarm/vm-manager/sdk/apierr"
)

func mustMAC(s string) net.HardwareAddr {
	m, err := net.ParseMAC(s)
	if err != nil {
		panic(err)
	}
	return m
}

func ethFrame(src, dst net.HardwareAddr, etherType uint16, payload []byte) []byte {
	b := make([]byte, 0, ethHeaderLen+len(payload))
	b = append(b, dst...)
	b = append(b, src...)
	b = binary.BigEndian.AppendUint16(b, etherType)
	return append(b, payload...)
}

// arpPacket is an Ethernet/IPv4 ARP packet (op 1 request, 2 reply).
func arpPacket(op uint16, sha net.HardwareAddr, spa netip.Addr, tha net.HardwareAddr, tpa netip.Addr) []byte {
	b := []byte{0, 1, 0x08, 0x00, 6, 4}
	b = binary.BigEndian.AppendUint16(b, op)
	b = append(b, sha...)
	b = append(b, spa.AsSlice()...)
	b = append(b, tha...)
	return append(b, tpa.AsSlice()...)
}

func arpRequest(mac net.HardwareAddr, spa, tpa netip.Addr) []byte {
	return ethFrame(mac, broadcastMAC, etherTypeARP, arpPacket(1, mac, spa, make(net.HardwareAddr, 6), tpa))
}

// ipv4Packet builds an IPv4 packet with options bytes of zeros (len a
// multiple of 4) and the given flags/fragment-offset field. The checksum is
// left zero: the filter does not look at it.
func ipv4Packet(src, dst netip.Addr, proto byte, options int, fragField uint16, payload []byte) []byte {
	ihl := ipv4MinLen + options
	b := make([]byte, ihl, ihl+len(payload))
	b[0] = 0x40 | byte(ihl/4)
	binary.BigEndian.PutUint16(b[2:4], uint16(ihl+len(payload)))
	binary.BigEndian.PutUint16(b[6:8], fragField)
	b[8] = 64
	b[9] = proto
	copy(b[12:16], src.AsSlice())
	copy(b[16:20], dst.AsSlice())
	return append(b, payload...)
}

func udpDatagram(sport, dport uint16, payload []byte) []byte {
	b := make([]byte, udpHeaderLen, udpHeaderLen+len(payload))
	binary.BigEndian.PutUint16(b[0:2], sport)
	binary.BigEndian.PutUint16(b[2:4], dport)
	binary.BigEndian.PutUint16(b[4:6], uint16(udpHeaderLen+len(payload)))
	return append(b, payload...)
}

func TestAllowed(t *testing.T) {
	ip := netip.MustParseAddr("10.1.0.5")
	other := netip.MustParseAddr("10.1.0.6")
	gw := netip.MustParseAddr("10.1.0.1")
	any4 := netip.IPv4Unspecified()
	mac := mustMAC(MAC("net", ip))
	otherMAC := mustMAC(MAC("net", other))
	gwMAC := mustMAC(GatewayMAC)
	zeroMAC := make(net.HardwareAddr, 6)
	tcp := make([]byte, 20)
	dhcp := udpDatagram(68, 67, []byte("discover"))

	ipv4 := func(src, dst netip.Addr, proto byte, payload []byte) []byte {
		return ethFrame(mac, gwMAC, etherTypeIPv4, ipv4Packet(src, dst, proto, 0, 0, payload))
	}
	vlan := append(binary.BigEndian.AppendUint16([]byte{0, 1}, etherTypeIPv4), ipv4Packet(ip, gw, 6, 0, 0, tcp)...)
	badARPType := arpPacket(1, mac, ip, zeroMAC, gw)
	badARPType[1] = 6 // htype IEEE 802

	for _, tc := range []struct {
		name  string
		frame []byte
		ok    bool
	}{
		{"ARP request from lease", arpRequest(mac, ip, gw), true},
		{"ARP reply from lease", ethFrame(mac, gwMAC, etherTypeARP, arpPacket(2, mac, ip, gwMAC, gw)), true},
		{"ARP probe from 0.0.0.0", arpRequest(mac, any4, ip), true},
		{"ARP with trailing padding", append(arpRequest(mac, ip, gw), make([]byte, 18)...), true},
		{"ARP with other sender IP", arpRequest(mac, other, gw), false},
		{"ARP with other sender MAC", ethFrame(mac, broadcastMAC, etherTypeARP, arpPacket(1, otherMAC, ip, zeroMAC, gw)), false},
		{"ARP from other Ethernet source", ethFrame(otherMAC, broadcastMAC, etherTypeARP, arpPacket(1, mac, ip, zeroMAC, gw)), false},
		{"ARP not Ethernet/IPv4", ethFrame(mac, broadcastMAC, etherTypeARP, badARPType), false},
		{"ARP truncated", arpRequest(mac, ip, gw)[:ethHeaderLen+20], false},
		{"IPv4 TCP from lease", ipv4(ip, gw, 6, tcp), true},
		{"IPv4 UDP from lease", ipv4(ip, gw, protoUDP, udpDatagram(5353, 53, nil)), true},
		{"IPv4 DHCP renew from lease", ipv4(ip, gw, protoUDP, dhcp), true},
		{"IPv4 from other IP", ipv4(other, gw, 6, tcp), false},
		{"IPv4 from gateway IP", ipv4(gw, other, protoUDP, dhcp), false},
		{"IPv4 from lease, other Ethernet source", ethFrame(otherMAC, gwMAC, etherTypeIPv4, ipv4Packet(ip, gw, 6, 0, 0, tcp)), false},
		{"IPv4 0.0.0.0 UDP to 67", ipv4(any4, netip.MustParseAddr("255.255.255.255"), protoUDP, dhcp), true},
		{"IPv4 0.0.0.0 UDP to 67, DF set", ethFrame(mac, broadcastMAC, etherTypeIPv4, ipv4Packet(any4, gw, protoUDP, 0, 0x4000, dhcp)), true},
		{"IPv4 0.0.0.0 UDP to 67 with options", ethFrame(mac, broadcastMAC, etherTypeIPv4, ipv4Packet(any4, gw, protoUDP, 4, 0, dhcp)), true},
		{"IPv4 0.0.0.0 UDP to 53", ipv4(any4, gw, protoUDP, udpDatagram(68, 53, nil)), false},
		{"IPv4 0.0.0.0 TCP to 67", ipv4(any4, gw, 6, append(binary.BigEndian.AppendUint16([]byte{0, 68}, 67), make([]byte, 16)...)), false},
		{"IPv4 0.0.0.0 UDP first fragment", ethFrame(mac, broadcastMAC, etherTypeIPv4, ipv4Packet(any4, gw, protoUDP, 0, 0x2000, dhcp)), false},
		{"IPv4 0.0.0.0 UDP later fragment", ethFrame(mac, broadcastMAC, etherTypeIPv4, ipv4Packet(any4, gw, protoUDP, 0, 0x0001, dhcp)), false},
		{"IPv4 0.0.0.0 UDP truncated", ipv4(any4, gw, protoUDP, dhcp[:3]), false},
		{"IPv4 header truncated", ipv4(ip, gw, 6, nil)[:ethHeaderLen+12], false},
		{"IPv4 IHL beyond packet", ethFrame(mac, gwMAC, etherTypeIPv4, append([]byte{0x4f}, ipv4Packet(ip, gw, 6, 0, 0, nil)[1:]...)), false},
		{"IPv4 EtherType, version 6", ethFrame(mac, gwMAC, etherTypeIPv4, append([]byte{0x65}, ipv4Packet(ip, gw, 6, 0, 0, tcp)[1:]...)), false},
		{"IPv6", ethFrame(mac, mustMAC("33:33:00:00:00:01"), 0x86dd, make([]byte, 40)), false},
		{"VLAN-tagged IPv4 from lease", ethFrame(mac, gwMAC, 0x8100, vlan), false},
		{"LLDP", ethFrame(mac, mustMAC("01:80:c2:00:00:0e"), 0x88cc, make([]byte, 46)), false},
		{"Ethernet header only", ethFrame(mac, gwMAC, etherTypeIPv4, nil), false},
		{"short frame", ethFrame(mac, gwMAC, etherTypeIPv4, nil)[:10], false},
		{"empty frame", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ok, reason := allowed(tc.frame, mac, ip)
			if ok != tc.ok {
				t.Fatalf("allowed = %v (%s), want %v", ok, reason, tc.ok)
			}
			if ok != (reason == "") {
				t.Fatalf("allowed = %v with reason %q", ok, reason)
			}
		})
	}
}

func framed(frames ...[]byte) []byte {
	var b []byte
	for _, f := range frames {
		b = binary.BigEndian.AppendUint32(b, uint32(len(f)))
		b = append(b, f...)
	}
	return b
}

// vmConn hands on only permitted frames, whole and with their length
// prefix, and ends on a bad length.
func TestVMConnFilters(t *testing.T) {
	ip := netip.MustParseAddr("10.1.0.5")
	gw := netip.MustParseAddr("10.1.0.1")
	mac := mustMAC(MAC("net", ip))
	good1 := arpRequest(mac, ip, gw)
	good2 := ethFrame(mac, mustMAC(GatewayMAC), etherTypeIPv4, ipv4Packet(ip, gw, 6, 0, 0, make([]byte, 1400)))
	spoof := arpRequest(mac, netip.MustParseAddr("10.1.0.6"), gw)
	ipv6 := ethFrame(mac, broadcastMAC, 0x86dd, make([]byte, 40))
	runt := []byte{1, 2, 3}

	for _, tc := range []struct {
		name    string
		stream  []byte
		want    []byte
		drops   uint64
		wantErr string
	}{
		{"mixed", framed(spoof, good1, ipv6, runt, good2, spoof), framed(good1, good2), 4, "EOF"},
		{"all dropped", framed(spoof, ipv6), nil, 2, "EOF"},
		// 192.168.1.1 is private: the default egress policy drops it (not
		// counted as spoofing).
		{"egress", framed(good1, ethFrame(mac, mustMAC(GatewayMAC), etherTypeIPv4, ipv4Packet(ip, netip.MustParseAddr("192.168.1.1"), 6, 0, 0, make([]byte, 20))), good2), framed(good1, good2), 0, "EOF"},
		{"zero length", append(framed(good1), 0, 0, 0, 0), framed(good1), 0, "frame length 0"},
		{"oversized", append(framed(good1), binary.BigEndian.AppendUint32(nil, maxFrame+1)...), framed(good1), 0, "frame length 65537"},
		{"truncated frame", framed(good1, good2)[:len(framed(good1, good2))-1], framed(good1), 0, "unexpected EOF"},
		{"truncated length", append(framed(good1), 0, 0), framed(good1), 0, "unexpected EOF"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			plan, _ := PlanFor("10.1.0.0/24")
			n := &Network{egress: egressPolicy{plan: plan}}
			vs := newVMState("vm", ip)
			c := &vmConn{n: n, mac: mac, ip: ip, vs: vs, log: slog.New(slog.DiscardHandler), isLease: n.isLease,
				pinned: func(int, netip.Addr) bool { return false }}
			c.r = bufio.NewReader(readCounter{bytes.NewReader(tc.stream), &n.fromVMs})
			// Small reads, as a bufio.Reader with a tiny buffer would do.
			var got []byte
			buf := make([]byte, 7)
			var err error
			for {
				var k int
				k, err = c.Read(buf)
				got = append(got, buf[:k]...)
				if err != nil {
					break
				}
			}
			if !bytes.Equal(got, tc.want) {
				t.Errorf("read %d bytes, want %d", len(got), len(tc.want))
			}
			if err == nil || !bytes.Contains([]byte(err.Error()), []byte(tc.wantErr)) {
				t.Errorf("err = %v, want %q", err, tc.wantErr)
			}
			if vs.dropped.Load() != tc.drops || n.dropped.Load() != tc.drops {
				t.Errorf("drops %d (network %d), want %d", vs.dropped.Load(), n.dropped.Load(), tc.drops)
			}
			if n.fromVMs.Load() != uint64(len(tc.stream)) {
				t.Errorf("counted %d bytes from the VM, want %d", n.fromVMs.Load(), len(tc.stream))
			}
		})
	}
}

// sendARP sends an ARP request for tpa from the guest's MAC with sender
// address spa.
func (g *fakeGuest) sendARP(spa, tpa netip.Addr) {
	g.t.Helper()
	if err := g.writeFrame(arpRequest(g.mac, spa, tpa)); err != nil {
		g.t.Fatalf("send ARP request: %v", err)
	}
}

// arpReply waits up to timeout for an ARP reply and returns its sender
// hardware and protocol addresses and its target protocol address.
func (g *fakeGuest) arpReply(timeout time.Duration) (sha net.HardwareAddr, spa, tpa netip.Addr, err error) {
	_ = g.conn.SetReadDeadline(time.Now().Add(timeout))
	defer func() { _ = g.conn.SetReadDeadline(time.Time{}) }()
	for {
		f, err := g.readFrame()
		if err != nil {
			return nil, netip.Addr{}, netip.Addr{}, err
		}
		if len(f) < ethHeaderLen+arpLen || binary.BigEndian.Uint16(f[12:14]) != etherTypeARP {
			continue
		}
		p := f[ethHeaderLen:]
		if binary.BigEndian.Uint16(p[6:8]) != 2 {
			continue
		}
		return net.HardwareAddr(p[8:14]), netip.AddrFrom4([4]byte(p[14:18])), netip.AddrFrom4([4]byte(p[24:28])), nil
	}
}

// askGateway sends an ARP request for the gateway from ip and expects the
// gateway's reply to ip.
func (g *fakeGuest) askGateway(n *Network, ip netip.Addr) {
	g.t.Helper()
	g.sendARP(ip, n.Plan().Gateway)
	sha, spa, tpa, err := g.arpReply(10 * time.Second)
	if err != nil {
		g.t.Fatalf("no ARP reply from the gateway: %v", err)
	}
	if sha.String() != GatewayMAC || spa != n.Plan().Gateway || tpa != ip {
		g.t.Fatalf("ARP reply %s is-at %s to %s, want %s is-at %s to %s", spa, sha, tpa, n.Plan().Gateway, GatewayMAC, ip)
	}
}

// expectNoARPReply fails if an ARP reply arrives within a generous wait.
func (g *fakeGuest) expectNoARPReply() {
	g.t.Helper()
	if sha, spa, tpa, err := g.arpReply(2 * time.Second); err == nil {
		g.t.Fatalf("got ARP reply %s is-at %s to %s", spa, sha, tpa)
	} else if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
		g.t.Fatalf("waiting for no ARP reply: %v", err)
	}
}

func TestAttachARPAntiSpoofing(t *testing.T) {
	n := startTest(t, Spec{Name: "arp", CIDR: "10.61.0.0/24"}, nil, nil)
	ip := mustAllocate(t, n, "vm-a")
	other := mustAllocate(t, n, "vm-b")
	g, _ := attachGuest(t, n, "vm-a")

	g.askGateway(n, ip)
	if d := n.Dropped("vm-a"); d != 0 {
		t.Fatalf("Dropped = %d after a good request", d)
	}

	// The same request claiming vm-b's address is not answered (and so does
	// not poison the gateway's neighbour cache).
	g.sendARP(other, n.Plan().Gateway)
	g.expectNoARPReply()
	poll.Until(t, "the spoofed request to be counted", func() bool { return n.Dropped("vm-a") == 1 })
	if st := n.Stats(); st.Dropped != 1 || st.Attachments != 1 {
		t.Fatalf("stats %+v", st)
	}
	if d := n.Dropped("vm-b"); d != 0 {
		t.Fatalf("vm-b's drops %d", d)
	}

	// The connection survives drops.
	g.askGateway(n, ip)
	if d := n.Dropped("vm-a"); d != 1 {
		t.Fatalf("Dropped = %d", d)
	}
}

// After QEMU drops the connection (as a hypervisor restart does from the
// other side), Attach dials again and the VM is back on the network.
func TestAttachRedial(t *testing.T) {
	n := startTest(t, Spec{Name: "redial", CIDR: "10.62.0.0/24"}, nil, nil)
	ip := mustAllocate(t, n, "vm")
	g1, q := attachGuest(t, n, "vm")
	g1.askGateway(n, ip)
	g1.sendARP(netip.MustParseAddr("10.62.0.99"), n.Plan().Gateway)
	poll.Until(t, "one drop", func() bool { return n.Dropped("vm") == 1 })

	if err := g1.conn.Close(); err != nil {
		t.Fatal(err)
	}
	g2 := q.accept(MAC(n.Name(), ip))
	g2.askGateway(n, ip)
	poll.Until(t, "one attachment", func() bool { return n.Stats().Attachments == 1 })
	if d := n.Dropped("vm"); d != 1 {
		t.Fatalf("Dropped after reconnect = %d, want 1", d)
	}

	// Release cuts the VM off, resets its counter and ends Attach.
	n.Release("vm")
	if err := q.result(5 * time.Second); !errors.Is(err, apierr.ErrConflict) {
		t.Fatalf("Attach after Release: %v, want conflict", err)
	}
	if d := n.Dropped("vm"); d != 0 {
		t.Fatalf("Dropped after Release = %d", d)
	}
	_ = g2.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.Copy(io.Discard, g2.r); err != nil {
		t.Fatalf("guest connection after Release: %v", err)
	}
	if st := n.Stats(); st.Attachments != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// Attach waits for QEMU to create its socket (missing, then refusing), and
// returns nil promptly once its context is cancelled, whether connected or
// still dialling.
func TestAttachWaitsAndCancels(t *testing.T) {
	var logs logtest.Buffer
	n, err := Start(t.Context(), Spec{Name: "wait", CIDR: "10.63.0.0/24"}, nil, nil, Limits{},
		slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})))
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { _ = n.Close() })
	// dialled waits until Attach has dialled sock and failed with why: it
	// logs each retry.
	dialled := func(sock, why string) {
		t.Helper()
		poll.Until(t, "Attach to dial "+sock+": "+why, func() bool {
			for _, line := range strings.Split(logs.String(), "\n") {
				if strings.Contains(line, "socket="+sock+" ") && strings.Contains(line, why) {
					return true
				}
			}
			return false
		})
	}
	ip := mustAllocate(t, n, "vm")
	q := newQEMU(t)
	q.attach(n, "vm")
	dialled(q.sock, "no such file or directory")

	// A stale socket file: connection refused.
	stale, err := net.ListenUnix("unix", &net.UnixAddr{Name: q.sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	stale.SetUnlinkOnClose(false)
	_ = stale.Close()
	dialled(q.sock, "connection refused")
	if err := os.Remove(q.sock); err != nil {
		t.Fatal(err)
	}

	q.listen()
	g := q.accept(MAC(n.Name(), ip))
	g.askGateway(n, ip)

	q.cancel()
	if err := q.result(5 * time.Second); err != nil {
		t.Fatalf("Attach after cancel: %v", err)
	}
	_ = g.conn.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.Copy(io.Discard, g.r); err != nil {
		t.Fatalf("guest connection after cancel: %v", err)
	}
	if st := n.Stats(); st.Attachments != 0 {
		t.Fatalf("stats %+v", st)
	}

	// Cancelled while the socket is missing.
	q2 := newQEMU(t)
	q2.attach(n, "vm")
	dialled(q2.sock, "no such file or directory")
	q2.cancel()
	if err := q2.result(5 * time.Second); err != nil {
		t.Fatalf("Attach after cancel while dialling: %v", err)
	}

	// Closing the network ends a dialling Attach too.
	q3 := newQEMU(t)
	q3.attach(n, "vm")
	dialled(q3.sock, "no such file or directory")
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	if err := q3.result(5 * time.Second); err != nil {
		t.Fatalf("Attach after Close while dialling: %v", err)
	}
}

func TestAttachErrors(t *testing.T) {
	n := startTest(t, Spec{Name: "errs", CIDR: "10.64.0.0/24"}, nil, nil)
	mustAllocate(t, n, "vm")
	sock := filepath.Join(t.TempDir(), "net.sock")
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()

	if err := n.Attach(ctx, "nobody", sock); !errors.Is(err, apierr.ErrConflict) {
		t.Fatalf("Attach without a lease: %v, want conflict", err)
	}
	if err := n.Attach(ctx, "", sock); !errors.Is(err, apierr.ErrConflict) {
		t.Fatalf("Attach with an empty id: %v, want conflict", err)
	}
	if err := n.Attach(ctx, "vm", ""); !errors.Is(err, apierr.ErrInvalid) {
		t.Fatalf("Attach with no socket: %v, want invalid", err)
	}
	long := "/" + string(bytesOf('x', MaxSocketPath))
	if err := n.Attach(ctx, "vm", long); !errors.Is(err, apierr.ErrInvalid) {
		t.Fatalf("Attach with a %d-byte socket path: %v, want invalid", len(long), err)
	}
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	if err := n.Attach(ctx, "vm", sock); !errors.Is(err, apierr.ErrConflict) {
		t.Fatalf("Attach on a closed network: %v, want conflict", err)
	}
	if err := ctx.Err(); err != nil {
		t.Fatal(fmt.Errorf("errors took the whole timeout: %w", err))
	}
}
