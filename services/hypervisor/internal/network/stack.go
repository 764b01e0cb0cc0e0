package network

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"

	"github.com/containers/gvisor-tap-vsock/pkg/services/dhcp"
	"github.com/containers/gvisor-tap-vsock/pkg/tap"
	"github.com/containers/gvisor-tap-vsock/pkg/types"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/network/arp"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/icmp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"
)

// userspace is one network's switch and gVisor stack. It is what
// virtualnetwork.New builds, minus the parts this package replaces: the NAT
// forwarders (nat.go: bounded per VM, policed), the DNS server (dns.go: the
// network's records and DNS policy) and port forwards (none). The switch,
// the link endpoint and DHCP stay gvisor-tap-vsock's.
type userspace struct {
	stack *stack.Stack
	sw    *tap.Switch
}

const nicID = 1

func newUserspace(cfg *types.Configuration) (*userspace, error) {
	_, subnet, err := net.ParseCIDR(cfg.Subnet)
	if err != nil {
		return nil, fmt.Errorf("parse subnet: %w", err)
	}
	pool := tap.NewIPPool(subnet)
	pool.Reserve(net.ParseIP(cfg.GatewayIP), cfg.GatewayMacAddress)
	for ip, mac := range cfg.DHCPStaticLeases {
		pool.Reserve(net.ParseIP(ip), mac)
	}
	if cfg.MTU <= 0 || cfg.MTU > math.MaxInt32 {
		return nil, errors.New("mtu is out of range")
	}
	ep, err := tap.NewLinkEndpoint(false, uint32(cfg.MTU), cfg.GatewayMacAddress, cfg.GatewayIP, cfg.GatewayVirtualIPs)
	if err != nil {
		return nil, fmt.Errorf("link endpoint: %w", err)
	}
	sw := tap.NewSwitch(false)
	ep.Connect(sw)
	sw.Connect(ep)

	s := stack.New(stack.Options{
		NetworkProtocols:   []stack.NetworkProtocolFactory{ipv4.NewProtocol, arp.NewProtocol},
		TransportProtocols: []stack.TransportProtocolFactory{tcp.NewProtocol, udp.NewProtocol, icmp.NewProtocol4},
	})
	if err := s.CreateNIC(nicID, ep); err != nil {
		return nil, errors.New(err.String())
	}
	gw := tcpip.AddrFrom4Slice(net.ParseIP(cfg.GatewayIP).To4())
	if err := s.AddProtocolAddress(nicID, tcpip.ProtocolAddress{Protocol: ipv4.ProtocolNumber, AddressWithPrefix: gw.WithPrefix()},
		stack.AddressProperties{}); err != nil {
		return nil, errors.New(err.String())
	}
	// Promiscuous with spoofing: the stack takes packets for any address
	// (that is the NAT) and answers from it.
	s.SetSpoofing(nicID, true)
	s.SetPromiscuousMode(nicID, true)
	sn, err := tcpip.NewSubnet(tcpip.AddrFromSlice(subnet.IP.To4()), tcpip.MaskFromBytes(subnet.Mask))
	if err != nil {
		return nil, fmt.Errorf("subnet: %w", err)
	}
	s.SetRouteTable([]tcpip.Route{{Destination: sn, NIC: nicID}})

	srv, err := dhcp.New(cfg, s, pool)
	if err != nil {
		return nil, fmt.Errorf("dhcp: %w", err)
	}
	// Serves until the process ends: gVisor stacks cannot be stopped.
	go func() { _ = srv.Serve() }()
	return &userspace{stack: s, sw: sw}, nil
}

func fullAddr(ap netip.AddrPort) tcpip.FullAddress {
	return tcpip.FullAddress{NIC: nicID, Addr: tcpip.AddrFrom4(ap.Addr().As4()), Port: ap.Port()}
}

// listenTCP listens on addr inside the network.
func (u *userspace) listenTCP(addr netip.AddrPort) (net.Listener, error) {
	return gonet.ListenTCP(u.stack, fullAddr(addr), ipv4.ProtocolNumber)
}

// listenUDP binds addr inside the network.
func (u *userspace) listenUDP(addr netip.AddrPort) (*gonet.UDPConn, error) {
	fa := fullAddr(addr)
	return gonet.DialUDP(u.stack, &fa, nil, ipv4.ProtocolNumber)
}

// dialTCP connects to addr inside the network, from the gateway.
func (u *userspace) dialTCP(ctx context.Context, addr netip.AddrPort) (net.Conn, error) {
	return gonet.DialContextTCP(ctx, u.stack, fullAddr(addr), ipv4.ProtocolNumber)
}

// forgetNeighbor drops the stack's ARP entry for ip: the switch learns a
// VM's MAC per connection from the frames the VM sends, and drops frames to
// a MAC it does not know, so after a VM's NIC is connected again (a resumed
// or re-adopted QEMU, which sends nothing by itself) the next packet to it
// asks by broadcast, and the VM's answer teaches the switch its port.
func (u *userspace) forgetNeighbor(ip netip.Addr) {
	if ip.Is4() {
		_ = u.stack.RemoveNeighbor(nicID, ipv4.ProtocolNumber, tcpip.AddrFrom4(ip.As4()))
	}
}

// accept runs a QEMU stream connection through the switch until it fails or
// ctx ends; it closes conn.
func (u *userspace) accept(ctx context.Context, conn net.Conn) error {
	return u.sw.Accept(ctx, conn, types.QemuProtocol)
}

func toAddr(a tcpip.Address) netip.Addr {
	if a.Len() != 4 {
		return netip.Addr{}
	}
	return netip.AddrFrom4(a.As4())
}
