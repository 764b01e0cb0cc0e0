package network

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// Redial backoff of Attach while QEMU's socket is missing or refuses.
const (
	minRedial = 50 * time.Millisecond
	maxRedial = time.Second
	// maxFrame bounds the length prefix of the QEMU stream framing.
	maxFrame = 64 << 10
)

// Attach connects the VM vmID to the network: it dials socketPath, the unix
// socket its QEMU listens on (-netdev stream,server=on), and serves the
// connection until ctx is done or the network is closed, redialling whenever
// QEMU drops it (and, with a backoff of 50 ms up to 1 s, while the socket
// does not exist yet or refuses connections). So a VM whose QEMU outlived a
// hypervisor restart is re-attached by calling Attach again.
//
// Frames from the VM pass only if they carry its own MAC and lease IP (see
// allowed) and the egress policy permits them; the others are dropped and
// counted (Stats, VMStats).
//
// Attach returns nil when ctx is done or the network is closed. vmID without
// a lease (also after Release, which disconnects the VM) or a network closed
// before the call is an apierr conflict; a bad socket path is an apierr
// invalid_request.
func (n *Network) Attach(ctx context.Context, vmID, socketPath string) error {
	if socketPath == "" || len(socketPath) > MaxSocketPath {
		return apierr.Invalidf("socketPath", "network socket path %q must be 1 to %d bytes long", socketPath, MaxSocketPath)
	}
	n.mu.Lock()
	if n.closed {
		n.mu.Unlock()
		return apierr.Errorf(apierr.Conflict, "network %s is closed", n.spec.Name)
	}
	if _, ok := n.leases[vmID]; !ok {
		n.mu.Unlock()
		return apierr.Errorf(apierr.Conflict, "vm %s has no lease in network %s", vmID, n.spec.Name)
	}
	// Close waits for this loop; closed is false, so Wait has not started.
	n.wg.Add(1)
	n.mu.Unlock()
	defer n.wg.Done()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(n.runCtx, cancel)()
	log := n.log.With("vm", vmID, "socket", socketPath)

	delay := minRedial
	var lastErr string
	for {
		n.mu.Lock()
		ip, ok := n.leases[vmID]
		n.mu.Unlock()
		if !ok {
			return apierr.Errorf(apierr.Conflict, "vm %s has no lease in network %s", vmID, n.spec.Name)
		}
		// Forgotten before the NIC connects, not after: a dial to the VM
		// made as soon as it is connected must find no entry to lose
		// (removing an entry being resolved fails its packets at once with
		// "no route to host").
		n.us.forgetNeighbor(ip)
		conn, err := (&net.Dialer{}).DialContext(ctx, "unix", socketPath)
		if ctx.Err() != nil {
			if conn != nil {
				_ = conn.Close()
			}
			return nil
		}
		if err != nil {
			if msg := err.Error(); errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) || msg == lastErr {
				log.Debug("QEMU network socket not ready, retrying", "err", err, "in", delay)
			} else {
				log.Warn("dialling QEMU network socket failed, retrying", "err", err, "in", delay)
			}
			lastErr = err.Error()
			if !sleep(ctx, delay) {
				return nil
			}
			delay = min(2*delay, maxRedial)
			continue
		}
		lastErr = ""
		since := time.Now()
		err = n.serve(ctx, vmID, conn, log)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			return err
		}
		// QEMU dropped the connection (it accepts the next one) or the guest
		// was cut off: redial, backing off if that keeps happening at once.
		if time.Since(since) > maxRedial {
			delay = minRedial
		}
		if !sleep(ctx, delay) {
			return nil
		}
		delay = min(2*delay, maxRedial)
	}
}

// serve runs one QEMU connection through the switch until it ends. It returns
// an error only if vmID has lost its lease (the connection is closed then).
func (n *Network) serve(ctx context.Context, vmID string, conn net.Conn, log *slog.Logger) error {
	n.mu.Lock()
	ip, ok := n.leases[vmID]
	if !ok || n.closed {
		n.mu.Unlock()
		_ = conn.Close()
		if !ok {
			return apierr.Errorf(apierr.Conflict, "vm %s has no lease in network %s", vmID, n.spec.Name)
		}
		return nil // closed: the caller's ctx is done
	}
	vs := n.vms[vmID]
	n.conns[conn] = vmID
	n.mu.Unlock()

	mac, _ := net.ParseMAC(MAC(n.spec.Name, ip))
	vc := &vmConn{Conn: conn, n: n, mac: mac, ip: ip, vs: vs, log: log, isLease: n.isLease}
	vc.pinned = func(rule int, ip netip.Addr) bool { return vs.pinned(rule, ip, time.Now()) }
	vc.r = bufio.NewReader(readCounter{conn, &n.fromVMs})
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	log.Info("VM attached", "ip", ip, "mac", mac.String())
	// accept returns when the connection fails or is closed; it closes
	// conn itself.
	err := n.us.accept(ctx, vc)
	stop()
	_ = conn.Close()
	n.mu.Lock()
	delete(n.conns, conn)
	n.mu.Unlock()
	if ctx.Err() == nil {
		log.Info("VM detached", "err", err)
	} else {
		log.Debug("VM detached", "err", err)
	}
	return nil
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

type readCounter struct {
	r io.Reader
	c *atomic.Uint64
}

func (r readCounter) Read(b []byte) (int, error) {
	k, err := r.r.Read(b)
	r.c.Add(uint64(max(k, 0)))
	return k, err
}

// vmConn is one VM's QEMU connection as the switch sees it: reads parse the
// QEMU stream framing (4-byte big-endian length, then the Ethernet frame) and
// return only whole frames that pass allowed, length prefix included; writes
// (frames to the VM) pass unfiltered. Both directions are counted.
type vmConn struct {
	net.Conn
	n   *Network
	mac net.HardwareAddr
	ip  netip.Addr
	vs  *vmState // the VM's counters, flows and pins
	log *slog.Logger
	// The egress policy's views of the network, made once, not per packet.
	isLease func(netip.Addr) bool
	pinned  func(rule int, ip netip.Addr) bool

	r       *bufio.Reader
	buf     [4 + maxFrame]byte
	pending []byte // the rest of the current permitted frame
	err     error
	warned  bool
}

func (c *vmConn) Read(b []byte) (int, error) {
	for len(c.pending) == 0 {
		if c.err != nil {
			return 0, c.err
		}
		c.pending, c.err = c.next()
	}
	k := copy(b, c.pending)
	c.pending = c.pending[k:]
	return k, nil
}

// next reads frames until one passes the filter and returns it with its
// length prefix.
func (c *vmConn) next() ([]byte, error) {
	for {
		if _, err := io.ReadFull(c.r, c.buf[:4]); err != nil {
			return nil, err
		}
		size := binary.BigEndian.Uint32(c.buf[:4])
		if size == 0 || size > maxFrame {
			return nil, fmt.Errorf("frame length %d out of range 1..%d", size, maxFrame)
		}
		frame := c.buf[4 : 4+size]
		if _, err := io.ReadFull(c.r, frame); err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return nil, err
		}
		ok, reason := allowed(frame, c.mac, c.ip)
		if ok && isIPv4(frame) {
			if ok, why, msg := c.permit(frame); !ok {
				c.vs.egress[why].Add(1)
				c.n.egressDropped.Add(1)
				c.log.Debug("dropping egress from VM", "reason", msg)
				continue
			}
		}
		if ok {
			return c.buf[:4+size], nil
		}
		c.vs.dropped.Add(1)
		c.n.dropped.Add(1)
		// IPv6 and the like are ordinary guest chatter; a foreign MAC or
		// address looks like spoofing and is worth one warning.
		if !c.warned && looksSpoofed(frame, c.mac) {
			c.warned = true
			c.log.Warn("dropping spoofed frame from VM (further drops on this connection are logged at debug level)", "reason", reason, "len", size)
		} else {
			c.log.Debug("dropping frame from VM", "reason", reason, "len", size)
		}
	}
}

// permit applies the egress policy to an IPv4 frame that allowed passed. A
// packet the rules refuse still passes if it belongs to a NAT flow that is
// open: the flow was allowed when it started (a domain rule's address may
// have expired since).
func (c *vmConn) permit(frame []byte) (bool, egressReason, string) {
	p := parsePacket(frame)
	ok, why, msg := c.n.egress.check(p, c.isLease, c.pinned)
	if !ok && why == egressRule && p.hasPorts && c.vs.hasFlow(flowKey{proto: p.proto,
		src: netip.AddrPortFrom(c.ip, p.sport), dst: netip.AddrPortFrom(p.dst, p.dport)}) {
		return true, 0, ""
	}
	return ok, why, msg
}

// parsePacket reads what the egress policy needs from an Ethernet frame
// carrying IPv4 (allowed has checked its header).
func parsePacket(frame []byte) packet {
	ethDst := frame[0:6]
	p := frame[ethHeaderLen:]
	ihl := int(p[0]&0x0f) * 4
	pk := packet{
		dst:     netip.AddrFrom4([4]byte(p[16:20])),
		proto:   p[9],
		toStack: bytes.Equal(ethDst, gatewayMAC) || bytes.Equal(ethDst, broadcastMAC),
		mayOpen: true,
	}
	// TCP and UDP carry ports, except in a non-first fragment.
	if (pk.proto == protoTCP || pk.proto == protoUDP) && binary.BigEndian.Uint16(p[6:8])&0x1fff == 0 && len(p) >= ihl+4 {
		pk.sport, pk.dport, pk.hasPorts = binary.BigEndian.Uint16(p[ihl:ihl+2]), binary.BigEndian.Uint16(p[ihl+2:ihl+4]), true
		if pk.proto == protoTCP && len(p) >= ihl+14 {
			flags := p[ihl+13]
			pk.mayOpen = flags&tcpSYN != 0 && flags&tcpACK == 0
		}
	}
	return pk
}

var (
	gatewayMAC, _ = net.ParseMAC(GatewayMAC)
	broadcastMAC  = net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
)

// isIPv4 is an Ethernet frame carrying IPv4 (allowed has checked its header).
func isIPv4(frame []byte) bool {
	return len(frame) >= ethHeaderLen+ipv4MinLen && binary.BigEndian.Uint16(frame[12:14]) == etherTypeIPv4
}

// looksSpoofed tells a dropped frame with a foreign source MAC, or ARP/IPv4
// with a foreign address, from one that is merely of a kind not carried.
func looksSpoofed(frame []byte, mac net.HardwareAddr) bool {
	if len(frame) < ethHeaderLen {
		return false
	}
	if !bytes.Equal(frame[6:12], mac) {
		return true
	}
	et := binary.BigEndian.Uint16(frame[12:14])
	return et == etherTypeARP || et == etherTypeIPv4
}

func (c *vmConn) Write(b []byte) (int, error) {
	k, err := c.Conn.Write(b)
	c.n.toVMs.Add(uint64(max(k, 0)))
	return k, err
}

// EtherTypes and offsets of the anti-spoofing filter.
const (
	etherTypeIPv4 = 0x0800
	etherTypeARP  = 0x0806
	ethHeaderLen  = 14
	arpLen        = 28 // Ethernet/IPv4 ARP
	ipv4MinLen    = 20
	udpHeaderLen  = 8
	protoICMP     = 1
	protoTCP      = 6
	protoUDP      = 17
	dhcpServer    = 67
	tcpSYN        = 0x02
	tcpACK        = 0x10
)

// allowed reports whether frame, an Ethernet frame from the VM with MAC mac
// and lease ip, may enter the network, and if not, why. Only these pass:
// ARP whose Ethernet source and sender hardware address are mac and whose
// sender protocol address is ip or 0.0.0.0 (probe); IPv4 from ip; and IPv4
// from 0.0.0.0 that is unfragmented UDP to port 67 (DHCP before the guest has
// its address). Everything else, IPv6 and VLAN-tagged frames included, is
// dropped.
func allowed(frame []byte, mac net.HardwareAddr, ip netip.Addr) (ok bool, reason string) {
	if len(frame) < ethHeaderLen {
		return false, "runt frame"
	}
	if !bytes.Equal(frame[6:12], mac) {
		return false, "Ethernet source is not the VM's MAC"
	}
	ip = ip.Unmap()
	p := frame[ethHeaderLen:]
	switch et := binary.BigEndian.Uint16(frame[12:14]); et {
	case etherTypeARP:
		if len(p) < arpLen {
			return false, "short ARP packet"
		}
		// htype Ethernet, ptype IPv4, hlen 6, plen 4.
		if binary.BigEndian.Uint16(p[0:2]) != 1 || binary.BigEndian.Uint16(p[2:4]) != etherTypeIPv4 || p[4] != 6 || p[5] != 4 {
			return false, "ARP packet is not Ethernet/IPv4"
		}
		if !bytes.Equal(p[8:14], mac) {
			return false, "ARP sender hardware address is not the VM's MAC"
		}
		if spa := netip.AddrFrom4([4]byte(p[14:18])); spa != ip && spa != netip.IPv4Unspecified() {
			return false, "ARP sender address " + spa.String() + " is not the VM's lease"
		}
		return true, ""
	case etherTypeIPv4:
		if len(p) < ipv4MinLen || p[0]>>4 != 4 {
			return false, "malformed IPv4 packet"
		}
		ihl := int(p[0]&0x0f) * 4
		if ihl < ipv4MinLen || len(p) < ihl {
			return false, "malformed IPv4 header"
		}
		src := netip.AddrFrom4([4]byte(p[12:16]))
		if src == ip {
			return true, ""
		}
		if src != netip.IPv4Unspecified() {
			return false, "IPv4 source " + src.String() + " is not the VM's lease"
		}
		// More-fragments flag or a fragment offset: no UDP header to trust.
		if p[9] != protoUDP || binary.BigEndian.Uint16(p[6:8])&0x3fff != 0 || len(p) < ihl+udpHeaderLen ||
			binary.BigEndian.Uint16(p[ihl+2:ihl+4]) != dhcpServer {
			return false, "IPv4 from 0.0.0.0 that is not DHCP to port 67"
		}
		return true, ""
	default:
		return false, fmt.Sprintf("EtherType 0x%04x", et)
	}
}
