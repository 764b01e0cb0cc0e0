package network

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"slices"

	"github.com/giantswarm/vm-manager/gen/apierr"
)

// Limits of a network's egress rules.
const (
	MaxEgressRules = 64
	MaxEgressPorts = 64
)

// EgressRule allows guest traffic through the NAT to a destination range,
// on the listed TCP/UDP ports (none: every port and protocol).
type EgressRule struct {
	Prefix netip.Prefix
	Ports  []uint16
}

// blockedByDefault are the destinations no guest reaches through the NAT
// unless a rule names them: the host's loopback and "this network", the
// private and shared ranges (the host's own networks, the pod network),
// link-local (cloud metadata services of the host; the IMDS is served
// inside the network), benchmarking and reserved space.
var blockedByDefault = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),
	netip.MustParsePrefix("10.0.0.0/8"),
	netip.MustParsePrefix("100.64.0.0/10"),
	netip.MustParsePrefix("127.0.0.0/8"),
	netip.MustParsePrefix("169.254.0.0/16"),
	netip.MustParsePrefix("172.16.0.0/12"),
	netip.MustParsePrefix("192.168.0.0/16"),
	netip.MustParsePrefix("198.18.0.0/15"),
	netip.MustParsePrefix("240.0.0.0/4"),
}

var (
	loopback  = netip.MustParsePrefix("127.0.0.0/8")
	multicast = netip.MustParsePrefix("224.0.0.0/4")
	broadcast = netip.MustParseAddr("255.255.255.255")
)

// ParseEgress validates API rules: IPv4 CIDRs (not inside loopback, which
// no rule opens), ports
// 1..65535, bounded counts. Errors are apierr invalid_request on field.
func ParseEgress(field string, cidrs []string, ports [][]uint32) ([]EgressRule, error) {
	if len(cidrs) > MaxEgressRules {
		return nil, apierr.Invalidf(field, "at most %d egress rules, got %d", MaxEgressRules, len(cidrs))
	}
	rules := make([]EgressRule, 0, len(cidrs))
	for i, c := range cidrs {
		p, err := netip.ParsePrefix(c)
		if err != nil || !p.Addr().Is4() {
			return nil, apierr.Invalidf(field, "%s[%d].cidr %q is not an IPv4 CIDR", field, i, c)
		}
		if p != p.Masked() {
			return nil, apierr.Invalidf(field, "%s[%d].cidr %q has host bits set (did you mean %s?)", field, i, c, p.Masked())
		}
		if loopback.Contains(p.Addr()) && p.Bits() >= loopback.Bits() {
			return nil, apierr.Invalidf(field, "%s[%d].cidr %q is in the loopback range 127.0.0.0/8, which guests never reach", field, i, c)
		}
		if len(ports[i]) > MaxEgressPorts {
			return nil, apierr.Invalidf(field, "%s[%d]: at most %d ports", field, i, MaxEgressPorts)
		}
		r := EgressRule{Prefix: p}
		for _, port := range ports[i] {
			if port < 1 || port > 65535 {
				return nil, apierr.Invalidf(field, "%s[%d]: port %d is outside 1..65535", field, i, port)
			}
			r.Ports = append(r.Ports, uint16(port))
		}
		slices.Sort(r.Ports)
		rules = append(rules, r)
	}
	return rules, nil
}

// egressPolicy decides which IPv4 packets a VM may send (contract §7.3:
// the original let guests reach whatever the host reaches).
type egressPolicy struct {
	local netip.Prefix // the network itself: gateway, DNS, DHCP, other VMs
	rules []EgressRule // empty: the default (everything but blockedByDefault)
}

// permit reports whether an IPv4 packet p (from the IP header on) may
// leave the VM, and if not, why.
func (e egressPolicy) permit(p []byte, ihl int) (bool, string) {
	dst := netip.AddrFrom4([4]byte(p[16:20]))
	if e.local.Contains(dst) || dst == IMDSAddr || dst == broadcast || multicast.Contains(dst) {
		return true, ""
	}
	if loopback.Contains(dst) {
		return false, fmt.Sprintf("egress to %s: the loopback range is never reachable", dst)
	}
	// TCP and UDP carry a destination port, except in a non-first fragment,
	// which only a portless rule admits.
	port, hasPort := uint16(0), false
	if proto := p[9]; (proto == protoTCP || proto == protoUDP) && binary.BigEndian.Uint16(p[6:8])&0x1fff == 0 && len(p) >= ihl+4 {
		port, hasPort = binary.BigEndian.Uint16(p[ihl+2:ihl+4]), true
	}
	if len(e.rules) == 0 {
		for _, b := range blockedByDefault {
			if b.Contains(dst) {
				return false, fmt.Sprintf("egress to %s (%s) is blocked by default; allow it with an egress rule", dst, b)
			}
		}
		return true, ""
	}
	for _, r := range e.rules {
		if !r.Prefix.Contains(dst) {
			continue
		}
		if len(r.Ports) == 0 {
			return true, ""
		}
		if hasPort {
			if _, found := slices.BinarySearch(r.Ports, port); found {
				return true, ""
			}
		}
	}
	if hasPort {
		return false, fmt.Sprintf("egress to %s port %d is not allowed by the network's rules", dst, port)
	}
	return false, fmt.Sprintf("egress to %s is not allowed by the network's rules", dst)
}
