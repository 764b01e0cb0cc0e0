// Package netcfg brings up the guest's first ethernet interface with DHCPv4 and
// configures the lease (address, default route, a route to the IMDS) through
// rtnetlink. Pure Go: vm-agent stays a static CGO_ENABLED=0 binary.
package netcfg

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/dhcpv4/nclient4"
	"github.com/jsimonetti/rtnetlink/v2/rtnl"
	"golang.org/x/sys/unix"
)

// IMDSAddr is the IMDS's virtual IP (contract §6.1).
var IMDSAddr = net.IPv4(169, 254, 169, 254).To4()

// ErrNoInterface means there is no ethernet interface to configure: the VM has
// no NIC, which is fine.
var ErrNoInterface = errors.New("no ethernet interface")

// Lease is what was configured.
type Lease struct {
	Interface string
	Addr      *net.IPNet // address and prefix
	Gateway   net.IP     // nil: the lease has no router
	DNS       []net.IP
	Server    net.IP        // DHCP server
	Duration  time.Duration // lease time (not renewed: the host's leases are static)
	IMDSRoute string        // how 169.254.169.254 is reached
}

func (l *Lease) String() string {
	gw := "no gateway"
	if l.Gateway != nil {
		gw = l.Gateway.String()
	}
	return fmt.Sprintf("%s via %s", l.Addr, gw)
}

// Options tune Configure; the zero value is the boot default.
type Options struct {
	Timeout  time.Duration // DHCP as a whole; default 10 s
	LinkWait time.Duration // wait for a NIC whose driver is bound; default 2 s
	Logf     func(format string, args ...any)
}

// Configure finds the first ethernet interface, brings it (and lo) up, runs DHCPv4
// and applies the lease. It returns ErrNoInterface at once when the VM has no NIC.
func Configure(ctx context.Context, opt Options) (*Lease, error) {
	opt = opt.withDefaults()
	ifc, c, err := open(ctx, opt)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	return configure(ctx, c, ifc, opt)
}

func (opt Options) withDefaults() Options {
	if opt.Timeout <= 0 {
		opt.Timeout = 10 * time.Second
	}
	if opt.LinkWait <= 0 {
		opt.LinkWait = 2 * time.Second
	}
	if opt.Logf == nil {
		opt.Logf = func(string, ...any) {}
	}
	return opt
}

// open waits for the first ethernet interface and dials rtnetlink.
func open(ctx context.Context, opt Options) (*net.Interface, *rtnl.Conn, error) {
	ifc, err := waitInterface(ctx, opt.LinkWait)
	if err != nil {
		return nil, nil, err
	}
	c, err := rtnl.Dial(nil)
	if err != nil {
		return nil, nil, fmt.Errorf("rtnetlink: %w", err)
	}
	return ifc, c, nil
}

// configure brings lo and ifc up, runs DHCPv4 on ifc and applies the lease.
func configure(ctx context.Context, c *rtnl.Conn, ifc *net.Interface, opt Options) (*Lease, error) {
	if lo, err := net.InterfaceByName("lo"); err == nil && lo.Flags&net.FlagUp == 0 {
		if err := c.LinkUp(lo); err != nil {
			opt.Logf("warning: lo up: %v", err)
		}
	}
	if err := c.LinkUp(ifc); err != nil {
		return nil, fmt.Errorf("%s up: %w", ifc.Name, err)
	}

	ctx, cancel := context.WithTimeout(ctx, opt.Timeout)
	defer cancel()
	ack, err := dhcp(ctx, ifc.Name)
	if err != nil {
		return nil, fmt.Errorf("dhcp on %s: %w", ifc.Name, err)
	}
	l, err := leaseFromACK(ifc.Name, ack)
	if err != nil {
		return nil, fmt.Errorf("dhcp on %s: %w", ifc.Name, err)
	}
	if err := apply(c, ifc, l); err != nil {
		return nil, err
	}
	return l, nil
}

// apply puts lease l on ifc: its address, the default route and the IMDS's
// route.
func apply(c *rtnl.Conn, ifc *net.Interface, l *Lease) error {
	if err := c.AddrAdd(ifc, l.Addr); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("address %s on %s: %w", l.Addr, ifc.Name, err)
	}
	if l.Gateway != nil {
		def := net.IPNet{IP: net.IPv4zero.To4(), Mask: net.CIDRMask(0, 32)}
		if err := c.RouteReplace(ifc, def, l.Gateway); err != nil {
			return fmt.Errorf("default route via %s: %w", l.Gateway, err)
		}
	}
	// The IMDS is a virtual IP of the gateway: the default route reaches it. Without
	// a router (or with a lease that happens to cover 169.254/16) it needs an
	// on-link /32 — the gateway answers ARP for it.
	switch {
	case l.Addr.Contains(IMDSAddr):
		l.IMDSRoute = "on-link (in the leased subnet)"
	case l.Gateway != nil:
		l.IMDSRoute = "via the default gateway"
	default:
		host := net.IPNet{IP: IMDSAddr, Mask: net.CIDRMask(32, 32)}
		if err := c.RouteReplace(ifc, host, nil); err != nil {
			return fmt.Errorf("route to %s: %w", IMDSAddr, err)
		}
		l.IMDSRoute = "on-link /32 on " + ifc.Name
	}
	return nil
}

// dhcp runs DISCOVER/OFFER/REQUEST/ACK. nclient4 retransmits within ctx.
func dhcp(ctx context.Context, iface string) (*dhcpv4.DHCPv4, error) {
	cl, err := nclient4.New(iface, nclient4.WithTimeout(2*time.Second), nclient4.WithRetry(5))
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	lease, err := cl.Request(ctx)
	if err != nil {
		return nil, err
	}
	return lease.ACK, nil
}

// leaseFromACK reads address, prefix, router and DNS out of a DHCPACK.
func leaseFromACK(iface string, ack *dhcpv4.DHCPv4) (*Lease, error) {
	ip := ack.YourIPAddr.To4()
	if ip == nil || ip.IsUnspecified() {
		return nil, fmt.Errorf("ACK without an address")
	}
	mask := ack.SubnetMask()
	if ones, bits := mask.Size(); bits != 32 || ones == 0 {
		mask = ip.DefaultMask() // classful fallback when the option is absent
	}
	l := &Lease{
		Interface: iface,
		Addr:      &net.IPNet{IP: ip, Mask: mask},
		DNS:       ack.DNS(),
		Server:    ack.ServerIdentifier(),
		Duration:  ack.IPAddressLeaseTime(0),
	}
	for _, r := range ack.Router() {
		if r4 := r.To4(); r4 != nil && !r4.IsUnspecified() {
			l.Gateway = r4
			break
		}
	}
	return l, nil
}

// waitInterface returns the first ethernet interface. With a virtio NIC bound to its
// driver it waits up to wait for the netdev; with none it fails at once, so a VM
// without a network does not boot slower.
func waitInterface(ctx context.Context, wait time.Duration) (*net.Interface, error) {
	deadline := time.Now().Add(wait)
	for {
		ifc, err := FirstEthernet()
		if err == nil || !errors.Is(err, ErrNoInterface) {
			return ifc, err
		}
		if !nicBound() || time.Now().After(deadline) {
			return nil, err
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func nicBound() bool {
	devs, _ := filepath.Glob("/sys/bus/virtio/drivers/virtio_net/virtio*")
	return len(devs) > 0
}

// FirstEthernet is the non-loopback interface with a 6-byte MAC and the lowest index
// (eth0 on the test guest; no udev renames it).
func FirstEthernet() (*net.Interface, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, err
	}
	return pickEthernet(ifs)
}

func pickEthernet(ifs []net.Interface) (*net.Interface, error) {
	sort.Slice(ifs, func(i, j int) bool { return ifs[i].Index < ifs[j].Index })
	for i := range ifs {
		ifc := &ifs[i]
		if ifc.Flags&net.FlagLoopback != 0 || len(ifc.HardwareAddr) != 6 {
			continue
		}
		// Tunnels and bridges the kernel creates itself are not the NIC.
		if strings.HasPrefix(ifc.Name, "sit") || strings.HasPrefix(ifc.Name, "tunl") ||
			strings.HasPrefix(ifc.Name, "gre") || strings.HasPrefix(ifc.Name, "ip6") {
			continue
		}
		return ifc, nil
	}
	return nil, ErrNoInterface
}

// Reidentify gives the first ethernet interface the MAC mac, drops its IPv4
// addresses and configures it again: a fork of this VM, restored on another
// port of the network, whose switch drops frames of the parent's MAC and
// address there. With static (the host told the fork its address; the
// network, gateway and DNS are the parent's) it applies that lease at once;
// without, it runs DHCP (Configure).
func Reidentify(ctx context.Context, mac net.HardwareAddr, static *Lease, opt Options) (*Lease, error) {
	opt = opt.withDefaults()
	ifc, c, err := open(ctx, opt)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	addrs, err := c.Addrs(ifc, unix.AF_INET)
	// virtio-net takes a new MAC while up (IFF_LIVE_ADDR_CHANGE); a NIC that
	// does not is taken down for it.
	if err == nil && c.LinkSetHardwareAddr(ifc, mac) != nil {
		err = c.LinkDown(ifc)
		if err == nil {
			err = c.LinkSetHardwareAddr(ifc, mac)
		}
	}
	for _, a := range addrs {
		if err == nil {
			if derr := c.AddrDel(ifc, a); derr != nil && !errors.Is(derr, os.ErrNotExist) {
				err = derr
			}
		}
	}
	if err != nil {
		return nil, fmt.Errorf("%s: new MAC %s: %w", ifc.Name, mac, err)
	}
	if static == nil {
		return configure(ctx, c, ifc, opt)
	}
	if err := c.LinkUp(ifc); err != nil {
		return nil, fmt.Errorf("%s up: %w", ifc.Name, err)
	}
	l := *static
	l.Interface = ifc.Name
	if err := apply(c, ifc, &l); err != nil {
		return nil, err
	}
	return &l, nil
}
