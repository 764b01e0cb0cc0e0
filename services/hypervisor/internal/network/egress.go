package network

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// Limits of a network's egress rules and DNS records.
const (
	MaxEgressRules = 64
	MaxEgressPorts = 64
	MaxDNSRecords  = 64
)

// EgressRule allows guest traffic through the NAT to a destination range,
// or to the addresses the network's DNS answered for a domain, on the listed
// TCP/UDP ports (none: every port and protocol). Exactly one of Prefix and
// Domain is set.
type EgressRule struct {
	Prefix netip.Prefix
	// Domain is a name ("api.example.com") or a wildcard ("*.example.com":
	// every name below, at any depth, not the name itself); lower case,
	// without the final dot.
	Domain string
	Ports  []uint16
}

// RuleSpec is an egress rule as the API has it.
type RuleSpec struct {
	CIDR, Domain string
	Ports        []uint32
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
	thisNet   = netip.MustParsePrefix("0.0.0.0/8")
	multicast = netip.MustParsePrefix("224.0.0.0/4")
	broadcast = netip.MustParseAddr("255.255.255.255")
)

// ParseEgress validates API rules: an IPv4 CIDR (not inside loopback, which
// no rule opens) or a domain, ports 1..65535, bounded counts. Errors are
// apierr invalid_request on field.
func ParseEgress(field string, in []RuleSpec) ([]EgressRule, error) {
	if len(in) > MaxEgressRules {
		return nil, apierr.Invalidf(field, "at most %d egress rules, got %d", MaxEgressRules, len(in))
	}
	rules := make([]EgressRule, 0, len(in))
	for i, s := range in {
		var r EgressRule
		switch {
		case s.CIDR != "" && s.Domain != "":
			return nil, apierr.Invalidf(field, "%s[%d] has both cidr and domain; give one", field, i)
		case s.Domain != "":
			d, ok := normalDomain(s.Domain, true)
			if !ok {
				return nil, apierr.Invalidf(field, "%s[%d].domain %q is not a DNS name or *.<DNS name>", field, i, s.Domain)
			}
			r.Domain = d
		default:
			p, err := netip.ParsePrefix(s.CIDR)
			if err != nil || !p.Addr().Is4() {
				return nil, apierr.Invalidf(field, "%s[%d].cidr %q is not an IPv4 CIDR", field, i, s.CIDR)
			}
			if p != p.Masked() {
				return nil, apierr.Invalidf(field, "%s[%d].cidr %q has host bits set (did you mean %s?)", field, i, s.CIDR, p.Masked())
			}
			if loopback.Contains(p.Addr()) && p.Bits() >= loopback.Bits() {
				return nil, apierr.Invalidf(field, "%s[%d].cidr %q is in the loopback range 127.0.0.0/8, which guests never reach", field, i, s.CIDR)
			}
			r.Prefix = p
		}
		if len(s.Ports) > MaxEgressPorts {
			return nil, apierr.Invalidf(field, "%s[%d]: at most %d ports", field, i, MaxEgressPorts)
		}
		for _, port := range s.Ports {
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

// normalDomain lower-cases d and drops a final dot; it is false unless the
// rest is a DNS name (with wildcard, optionally "*." before one).
func normalDomain(d string, wildcard bool) (string, bool) {
	d = strings.TrimSuffix(strings.ToLower(d), ".")
	name := d
	if wildcard {
		name = strings.TrimPrefix(d, "*.")
	}
	return d, name != "" && validDomain(name) && !strings.HasSuffix(name, ".")
}

// matchesName reports whether name (lower case, no final dot) is a domain
// rule's name, or below its wildcard.
func (r EgressRule) matchesName(name string) bool {
	if suffix, ok := strings.CutPrefix(r.Domain, "*"); ok {
		return strings.HasSuffix(name, suffix) && len(name) > len(suffix)
	}
	return r.Domain != "" && name == r.Domain
}

func (r EgressRule) allowsPort(p packet) bool {
	if len(r.Ports) == 0 {
		return true
	}
	if !p.hasPorts {
		return false
	}
	_, found := slices.BinarySearch(r.Ports, p.dport)
	return found
}

// DNSRecord is an A record the network's DNS answers itself.
type DNSRecord struct {
	Name string // lower case, no final dot
	IP   netip.Addr
}

// ParseDNSRecords validates API records: DNS names without wildcards,
// IPv4 addresses a guest can reach, no record twice. Errors are apierr
// invalid_request on field.
func ParseDNSRecords(field string, names, ips []string) ([]DNSRecord, error) {
	if len(names) > MaxDNSRecords {
		return nil, apierr.Invalidf(field, "at most %d DNS records, got %d", MaxDNSRecords, len(names))
	}
	out := make([]DNSRecord, 0, len(names))
	for i := range names {
		name, ok := normalDomain(names[i], false)
		if !ok {
			return nil, apierr.Invalidf(field, "%s[%d].name %q is not a DNS name", field, i, names[i])
		}
		ip, err := netip.ParseAddr(ips[i])
		if err != nil || !ip.Is4() {
			return nil, apierr.Invalidf(field, "%s[%d].ip %q is not an IPv4 address", field, i, ips[i])
		}
		if loopback.Contains(ip) || thisNet.Contains(ip) || multicast.Contains(ip) || ip == broadcast {
			return nil, apierr.Invalidf(field, "%s[%d].ip %s is a loopback, unspecified, multicast or broadcast address", field, i, ip)
		}
		r := DNSRecord{Name: name, IP: ip}
		if slices.Contains(out, r) {
			return nil, apierr.Invalidf(field, "%s[%d]: %s %s is listed twice", field, i, name, ip)
		}
		out = append(out, r)
	}
	return out, nil
}

// packet is what the egress policy looks at in an IPv4 packet from a VM.
type packet struct {
	dst          netip.Addr
	proto        uint8
	sport, dport uint16
	hasPorts     bool // TCP or UDP, and not a later fragment
	// mayOpen is TCP that may open a connection: a SYN without ACK, or a
	// fragment whose flags cannot be seen. Other segments can only belong
	// to a connection the stack has.
	mayOpen bool
	toStack bool // to the gateway's MAC or broadcast: the stack (and so the NAT) gets it
}

// egressPolicy decides which IPv4 packets a VM may send (contract §7.3:
// the original let guests reach whatever the host reaches).
type egressPolicy struct {
	plan  Plan
	rules []EgressRule // empty: the default (everything but blockedByDefault)
}

// check reports whether p may leave the VM, and if not, why. isLease says
// whether an address is a VM's of this network, pinned whether the network's
// DNS answered an address for the domain rule i (for this VM, recently).
func (e egressPolicy) check(p packet, isLease func(netip.Addr) bool, pinned func(i int, ip netip.Addr) bool) (bool, egressReason, string) {
	dst := p.dst
	switch {
	case dst == broadcast || multicast.Contains(dst):
		// The switch floods or drops these; the NAT never takes them.
		return true, 0, ""
	case dst == IMDSAddr:
		// TCP segments other than a SYN may belong to a connection the
		// stack has; only SYNs open new ones.
		if p.proto == protoICMP || p.proto == protoTCP && (p.dport == imdsPort || !p.mayOpen) {
			return true, 0, ""
		}
		return false, egressLocal, fmt.Sprintf("egress to %s: the IMDS serves TCP port %d only", dst, imdsPort)
	case loopback.Contains(dst):
		return false, egressRule, fmt.Sprintf("egress to %s: the loopback range is never reachable", dst)
	case e.plan.Prefix.Contains(dst):
		return e.checkLocal(p, isLease)
	}
	if len(e.rules) == 0 {
		for _, b := range blockedByDefault {
			if b.Contains(dst) {
				return false, egressRule, fmt.Sprintf("egress to %s (%s) is blocked by default; allow it with an egress rule", dst, b)
			}
		}
		return true, 0, ""
	}
	for i, r := range e.rules {
		if !r.allowsPort(p) {
			continue
		}
		if r.Domain == "" && r.Prefix.Contains(dst) || r.Domain != "" && pinned(i, dst) {
			return true, 0, ""
		}
	}
	if p.hasPorts {
		return false, egressRule, fmt.Sprintf("egress to %s port %d is not allowed by the network's rules", dst, p.dport)
	}
	return false, egressRule, fmt.Sprintf("egress to %s is not allowed by the network's rules", dst)
}

// checkLocal decides for a destination inside the network. The stack sends
// whatever reaches it for an address it does not serve to the host's address
// of the same number, so what goes to the stack must be one of its services
// (or named by a rule), and only other VMs are reached on the switch.
func (e egressPolicy) checkLocal(p packet, isLease func(netip.Addr) bool) (bool, egressReason, string) {
	dst := p.dst
	switch {
	case dst == e.plan.Gateway:
		if p.proto == protoICMP ||
			p.proto == protoUDP && p.hasPorts && (p.dport == dnsPort || p.dport == dhcpServer) ||
			p.proto == protoTCP && (p.dport == dnsPort || !p.mayOpen) {
			return true, 0, ""
		}
		return false, egressLocal, fmt.Sprintf("egress to the gateway %s: it serves DHCP and DNS only", dst)
	case dst == e.plan.Broadcast:
		return true, 0, ""
	case dst == e.plan.HostAlias:
		return false, egressLocal, fmt.Sprintf("egress to the host alias %s: it never reaches the host", dst)
	case !p.toStack && isLease(dst):
		return true, 0, "" // VM to VM, on the switch
	case e.localRuleAllows(p):
		return true, 0, ""
	case p.toStack && isLease(dst):
		return false, egressLocal, fmt.Sprintf("egress to %s through the gateway: VMs are reached directly", dst)
	}
	return false, egressLocal, fmt.Sprintf("egress to %s: no VM of the network has that address", dst)
}

// localRuleAllows is a CIDR rule naming an address inside the network (the
// NAT then takes it to the host's address of the same number).
func (e egressPolicy) localRuleAllows(p packet) bool {
	for _, r := range e.rules {
		if r.Domain == "" && r.Prefix.Contains(p.dst) && r.allowsPort(p) {
			return true
		}
	}
	return false
}

// natRefuses is the NAT's own check of a new flow's destination, behind the
// packet filter: never the host's loopback, link-local, multicast or
// broadcast addresses, and inside the network only what a rule names (the
// gateway, host alias and the network's broadcast address never). silent
// is for destinations a guest reaches by broadcasting, not worth counting.
func (e egressPolicy) natRefuses(proto uint8, dst netip.AddrPort) (refuse, silent bool) {
	a := dst.Addr()
	switch {
	case !a.Is4() || a == broadcast || multicast.Contains(a) || a == e.plan.Broadcast:
		return true, true
	case loopback.Contains(a) || linkLocal.Contains(a) || thisNet.Contains(a):
		return true, false
	case e.plan.Prefix.Contains(a):
		if a == e.plan.Gateway || a == e.plan.HostAlias || a == e.plan.Prefix.Addr() {
			return true, false
		}
		return !e.localRuleAllows(packet{dst: a, proto: proto, dport: dst.Port(), hasPorts: true}), false
	}
	return false, false
}
