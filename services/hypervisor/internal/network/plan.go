// Package network runs rootless userspace networks for VMs: one
// gvisor-tap-vsock virtual network (L2 switch plus a gVisor stack acting as
// gateway, DHCP server, DNS forwarder, NAT and IMDS host) per network. Each
// VM's QEMU listens on its own unix socket (QEMU "stream" framing) and the
// network dials it (Network.Attach), so it can tell VMs apart and drop frames
// that spoof another VM's MAC or IP.
package network

import (
	"fmt"
	"hash/fnv"
	"net/netip"
	"regexp"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// Prefix bounds of a network CIDR.
const (
	MinPrefixBits = 16
	MaxPrefixBits = 29
)

// IMDSAddr is the link-local address the metadata service answers on inside
// every network.
var IMDSAddr = netip.MustParseAddr("169.254.169.254")

var (
	nameRE    = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)
	linkLocal = netip.MustParsePrefix("169.254.0.0/16")
)

// Spec describes one network as the API accepts it.
type Spec struct {
	Name            string
	CIDR            string
	DNSSearchDomain string
	// Egress allows guest traffic through the NAT (ParseEgress validates
	// the API's rules); empty is the default policy (see blockedByDefault).
	Egress []EgressRule
	// DNSRecords are answered by the network's DNS itself
	// (ParseDNSRecords validates them); DNSPolicy says what else it resolves.
	DNSRecords []DNSRecord
	DNSPolicy  DNSPolicy
}

// Validate checks a Spec; every failure is an apierr invalid_request.
func Validate(s Spec) error {
	if !nameRE.MatchString(s.Name) {
		return apierr.Invalidf("name", "invalid network name %q: must be a DNS label (lower-case letters, digits and '-', 1-63 characters)", s.Name)
	}
	if _, err := PlanFor(s.CIDR); err != nil {
		return err
	}
	if s.DNSSearchDomain != "" && !validDomain(s.DNSSearchDomain) {
		return apierr.Invalidf("dnsSearchDomain", "invalid DNS search domain %q", s.DNSSearchDomain)
	}
	return nil
}

var domainRE = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*\.?$`)

func validDomain(d string) bool { return len(d) <= 253 && domainRE.MatchString(d) }

// Plan is the address plan of a network.
type Plan struct {
	Prefix    netip.Prefix // masked network prefix
	Gateway   netip.Addr   // .1: gateway, DHCP and DNS
	HostAlias netip.Addr   // broadcast-1 (.254 in a /24); never leased
	Broadcast netip.Addr
	PoolFirst netip.Addr // .2
	PoolLast  netip.Addr // broadcast-2 (.253 in a /24)
}

// PlanFor parses an IPv4 CIDR (/16 to /29, not overlapping 169.254.0.0/16)
// and returns its address plan. Errors are apierr invalid_request.
func PlanFor(cidr string) (Plan, error) {
	p, err := netip.ParsePrefix(cidr)
	if err != nil {
		return Plan{}, apierr.Invalidf("cidr", "invalid CIDR %q: %v", cidr, err)
	}
	if !p.Addr().Is4() {
		return Plan{}, apierr.Invalidf("cidr", "invalid CIDR %q: only IPv4 is supported", cidr)
	}
	if b := p.Bits(); b < MinPrefixBits || b > MaxPrefixBits {
		return Plan{}, apierr.Invalidf("cidr", "invalid CIDR %q: prefix length must be between /%d and /%d", cidr, MinPrefixBits, MaxPrefixBits)
	}
	p = p.Masked()
	if p.Overlaps(linkLocal) {
		return Plan{}, apierr.Invalidf("cidr", "invalid CIDR %q: overlaps the link-local range %s", cidr, linkLocal)
	}
	base := toU32(p.Addr())
	size := uint32(1) << (32 - p.Bits())
	bcast := base + size - 1
	return Plan{
		Prefix:    p,
		Gateway:   fromU32(base + 1),
		HostAlias: fromU32(bcast - 1),
		Broadcast: fromU32(bcast),
		PoolFirst: fromU32(base + 2),
		PoolLast:  fromU32(bcast - 2),
	}, nil
}

// PoolSize is the number of leasable addresses: 2^(32-bits) - 4.
func (p Plan) PoolSize() int { return int(toU32(p.PoolLast)-toU32(p.PoolFirst)) + 1 }

// InPool reports whether ip is a leasable address of the plan.
func (p Plan) InPool(ip netip.Addr) bool {
	if !ip.Is4() {
		return false
	}
	v := toU32(ip)
	return v >= toU32(p.PoolFirst) && v <= toU32(p.PoolLast)
}

// MAC returns the guest MAC address for ip on the named network:
// 02:<low byte of fnv32a(network)>:<the 4 IPv4 bytes>. ip must be IPv4.
func MAC(network string, ip netip.Addr) string {
	h := fnv.New32a()
	_, _ = h.Write([]byte(network))
	b := ip.Unmap().As4()
	return fmt.Sprintf("02:%02x:%02x:%02x:%02x:%02x", byte(h.Sum32()), b[0], b[1], b[2], b[3])
}

func toU32(a netip.Addr) uint32 {
	b := a.Unmap().As4()
	return uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
}

func fromU32(v uint32) netip.Addr {
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}
