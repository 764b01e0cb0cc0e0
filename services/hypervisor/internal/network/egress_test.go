package network

import (
	"encoding/binary"
	"net/netip"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

func tcpTo(dst string, port uint16) []byte {
	return tcpSeg("10.1.0.5", dst, port, tcpACK)
}

// tcpSeg is an IPv4 TCP segment with the given flags.
func tcpSeg(src, dst string, port uint16, flags byte) []byte {
	seg := make([]byte, 20)
	binary.BigEndian.PutUint16(seg[0:2], 40000)
	binary.BigEndian.PutUint16(seg[2:4], port)
	seg[12] = 5 << 4
	seg[13] = flags
	return ipv4Packet(netip.MustParseAddr(src), netip.MustParseAddr(dst), protoTCP, 0, 0, seg)
}

func udpTo(dst string, port uint16) []byte {
	return ipv4Packet(netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr(dst), protoUDP, 0, 0, udpDatagram(40000, port, nil))
}

// viaGateway and onSwitch frame an IPv4 packet from 10.1.0.5 to the
// gateway's MAC (the stack, the NAT) or to another VM's.
func viaGateway(ip []byte) packet {
	return parsePacket(ethFrame(mustMAC(MAC("net", netip.MustParseAddr("10.1.0.5"))), mustMAC(GatewayMAC), etherTypeIPv4, ip))
}

func onSwitch(ip []byte) packet {
	return parsePacket(ethFrame(mustMAC(MAC("net", netip.MustParseAddr("10.1.0.5"))), mustMAC(MAC("net", netip.MustParseAddr("10.1.0.7"))), etherTypeIPv4, ip))
}

func mustRules(t *testing.T, rules ...RuleSpec) []EgressRule {
	t.Helper()
	r, err := ParseEgress("egress", rules)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func TestEgressPolicy(t *testing.T) {
	plan, _ := PlanFor("10.1.0.0/24")
	def := egressPolicy{plan: plan}
	allow := egressPolicy{plan: plan, rules: mustRules(t,
		RuleSpec{CIDR: "192.168.7.0/24", Ports: []uint32{443, 80}},
		RuleSpec{CIDR: "93.184.0.0/16"},
		RuleSpec{Domain: "*.example.com", Ports: []uint32{443}},
	)}
	// The network's own range named by a rule: reached through the NAT, but
	// never the gateway's other ports or the host alias.
	own := egressPolicy{plan: plan, rules: mustRules(t, RuleSpec{CIDR: "10.0.0.0/8"})}
	everything := egressPolicy{plan: plan, rules: mustRules(t, RuleSpec{CIDR: "0.0.0.0/0"})}
	icmp := ipv4Packet(netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("192.168.7.9"), 1, 0, 0, make([]byte, 8))
	frag := ipv4Packet(netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("192.168.7.9"), protoTCP, 0, 0x0010, make([]byte, 8))
	syn := func(dst string, port uint16) []byte { return tcpSeg("10.1.0.5", dst, port, tcpSYN) }
	for _, tc := range []struct {
		name   string
		policy egressPolicy
		pkt    packet
		want   bool
		why    egressReason
		reason string
	}{
		{"default: DNS at the gateway", def, viaGateway(udpTo("10.1.0.1", 53)), true, 0, ""},
		{"default: DNS over TCP at the gateway", def, viaGateway(syn("10.1.0.1", 53)), true, 0, ""},
		{"default: DHCP at the gateway", def, viaGateway(udpTo("10.1.0.1", 67)), true, 0, ""},
		{"default: ping the gateway", def, viaGateway(ipv4Packet(netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("10.1.0.1"), 1, 0, 0, make([]byte, 8))), true, 0, ""},
		{"default: another gateway port", def, viaGateway(syn("10.1.0.1", 8080)), false, egressLocal, "serves DHCP and DNS only"},
		{"default: UDP to another gateway port", def, viaGateway(udpTo("10.1.0.1", 8080)), false, egressLocal, "serves DHCP and DNS only"},
		{"default: the stack's own connection (exec)", def, viaGateway(tcpTo("10.1.0.1", 41234)), true, 0, ""},
		{"default: IMDS", def, viaGateway(syn("169.254.169.254", 80)), true, 0, ""},
		{"default: another IMDS port", def, viaGateway(syn("169.254.169.254", 8080)), false, egressLocal, "TCP port 80 only"},
		{"default: UDP to the IMDS", def, viaGateway(udpTo("169.254.169.254", 53)), false, egressLocal, "TCP port 80 only"},
		{"default: host alias", def, viaGateway(syn("10.1.0.254", 22)), false, egressLocal, "host alias"},
		{"default: a free address", def, viaGateway(syn("10.1.0.77", 22)), false, egressLocal, "no VM"},
		{"default: a free address on the switch", def, onSwitch(syn("10.1.0.77", 22)), false, egressLocal, "no VM"},
		{"default: another VM", def, onSwitch(syn("10.1.0.7", 22)), true, 0, ""},
		{"default: another VM through the gateway", def, viaGateway(syn("10.1.0.7", 22)), false, egressLocal, "through the gateway"},
		{"default: the network's broadcast", def, onSwitch(udpTo("10.1.0.255", 137)), true, 0, ""},
		{"default: broadcast", def, viaGateway(udpTo("255.255.255.255", 67)), true, 0, ""},
		{"default: public", def, viaGateway(tcpTo("93.184.216.34", 443)), true, 0, ""},
		{"default: other private", def, viaGateway(tcpTo("10.2.0.1", 22)), false, egressRule, "blocked by default"},
		{"default: host LAN", def, viaGateway(tcpTo("192.168.1.1", 80)), false, egressRule, "192.168.0.0/16"},
		{"default: link-local", def, viaGateway(tcpTo("169.254.1.1", 80)), false, egressRule, "169.254.0.0/16"},
		{"default: shared", def, viaGateway(tcpTo("100.64.0.1", 80)), false, egressRule, "blocked by default"},
		{"rules: allowed port", allow, viaGateway(tcpTo("192.168.7.9", 443)), true, 0, ""},
		{"rules: other port", allow, viaGateway(tcpTo("192.168.7.9", 22)), false, egressRule, "port 22 is not allowed"},
		{"rules: portless rule", allow, viaGateway(tcpTo("93.184.216.34", 8443)), true, 0, ""},
		{"rules: public not listed", allow, viaGateway(tcpTo("8.8.8.8", 443)), false, egressRule, "not allowed by the network's rules"},
		{"rules: another VM", allow, onSwitch(tcpTo("10.1.0.7", 22)), true, 0, ""},
		{"rules: a free address", allow, viaGateway(syn("10.1.0.9", 22)), false, egressLocal, "no VM"},
		{"rules: ICMP to a ported rule", allow, viaGateway(icmp), false, egressRule, "not allowed"},
		{"rules: fragment to a ported rule", allow, viaGateway(frag), false, egressRule, "not allowed"},
		{"rules: a domain rule's pinned address", allow, viaGateway(syn("203.0.113.9", 443)), true, 0, ""},
		{"rules: a domain rule's pinned address, other port", allow, viaGateway(syn("203.0.113.9", 80)), false, egressRule, "port 80"},
		{"rules: an address no answer pinned", allow, viaGateway(syn("203.0.113.10", 443)), false, egressRule, "not allowed"},
		{"own range: a free address", own, viaGateway(syn("10.1.0.77", 22)), true, 0, ""},
		{"own range: the gateway's other ports", own, viaGateway(syn("10.1.0.1", 8080)), false, egressLocal, "serves DHCP and DNS only"},
		{"own range: host alias", own, viaGateway(syn("10.1.0.254", 22)), false, egressLocal, "host alias"},
		{"everything: still no loopback", everything, viaGateway(tcpTo("127.0.0.1", 8080)), false, egressRule, "loopback"},
		{"everything: private", everything, viaGateway(tcpTo("10.9.9.9", 8080)), true, 0, ""},
		{"everything: still not the alias", everything, viaGateway(syn("10.1.0.254", 22)), false, egressLocal, "host alias"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			isLease := func(ip netip.Addr) bool { return ip.String() == "10.1.0.5" || ip.String() == "10.1.0.7" }
			pinned := func(i int, ip netip.Addr) bool { return i == 2 && ip.String() == "203.0.113.9" }
			ok, why, reason := tc.policy.check(tc.pkt, isLease, pinned)
			if ok != tc.want || !strings.Contains(reason, tc.reason) || !ok && why != tc.why {
				t.Errorf("check = %v %s %q, want %v %s %q", ok, egressNames[why], reason, tc.want, egressNames[tc.why], tc.reason)
			}
		})
	}
}

func TestParsePacket(t *testing.T) {
	mac := mustMAC(MAC("net", netip.MustParseAddr("10.1.0.5")))
	frame := func(ip []byte) []byte { return ethFrame(mac, mustMAC(GatewayMAC), etherTypeIPv4, ip) }
	if p := parsePacket(frame(tcpSeg("10.1.0.5", "10.1.0.1", 8080, tcpSYN))); !p.mayOpen || !p.toStack || p.dport != 8080 || !p.hasPorts {
		t.Errorf("SYN: %+v", p)
	}
	if p := parsePacket(frame(tcpSeg("10.1.0.5", "10.1.0.1", 8080, tcpSYN|tcpACK))); p.mayOpen {
		t.Errorf("SYN-ACK may open: %+v", p)
	}
	// A first fragment too short to show the flags may be a SYN.
	short := ipv4Packet(netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("10.1.0.1"), protoTCP, 0, 0x2000, make([]byte, 8))
	if p := parsePacket(frame(short)); !p.mayOpen || !p.hasPorts {
		t.Errorf("tiny first fragment: %+v", p)
	}
	later := ipv4Packet(netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("10.1.0.1"), protoTCP, 0, 0x0001, make([]byte, 20))
	if p := parsePacket(frame(later)); !p.mayOpen || p.hasPorts {
		t.Errorf("later fragment: %+v", p)
	}
	if p := parsePacket(ethFrame(mac, broadcastMAC, etherTypeIPv4, udpTo("10.1.0.7", 9))); !p.toStack {
		t.Errorf("broadcast frame does not reach the stack: %+v", p)
	}
	if p := parsePacket(ethFrame(mac, mustMAC(MAC("net", netip.MustParseAddr("10.1.0.7"))), etherTypeIPv4, udpTo("10.1.0.7", 9))); p.toStack {
		t.Errorf("frame to a VM reaches the stack: %+v", p)
	}
}

func TestNATRefuses(t *testing.T) {
	plan, _ := PlanFor("10.1.0.0/24")
	def := egressPolicy{plan: plan}
	own := egressPolicy{plan: plan, rules: mustRules(t, RuleSpec{CIDR: "10.1.0.0/24", Ports: []uint32{22}})}
	for _, tc := range []struct {
		policy          egressPolicy
		dst             string
		refuse, silence bool
	}{
		{def, "93.184.216.34:443", false, false},
		{def, "127.0.0.1:22", true, false},
		{def, "169.254.169.254:8080", true, false},
		{def, "0.1.2.3:22", true, false},
		{def, "255.255.255.255:67", true, true},
		{def, "224.0.0.251:5353", true, true},
		{def, "10.1.0.255:137", true, true},
		{def, "10.1.0.1:8080", true, false},
		{def, "10.1.0.254:22", true, false},
		{def, "10.1.0.77:22", true, false},
		{own, "10.1.0.77:22", false, false},
		{own, "10.1.0.77:23", true, false},
		{own, "10.1.0.1:22", true, false},
		{own, "10.1.0.254:22", true, false},
		{own, "10.1.0.0:22", true, false},
	} {
		refuse, silent := tc.policy.natRefuses(protoTCP, netip.MustParseAddrPort(tc.dst))
		if refuse != tc.refuse || silent != tc.silence {
			t.Errorf("%s (rules %v): refuse %v silent %v, want %v %v", tc.dst, tc.policy.rules, refuse, silent, tc.refuse, tc.silence)
		}
	}
}

func TestDomainMatch(t *testing.T) {
	rules := mustRules(t, RuleSpec{Domain: "API.Example.com."}, RuleSpec{Domain: "*.svc.example.com"})
	for name, want := range map[string][2]bool{
		"api.example.com":        {true, false},
		"x.api.example.com":      {false, false},
		"svc.example.com":        {false, false},
		"a.svc.example.com":      {false, true},
		"a.b.svc.example.com":    {false, true},
		"asvc.example.com":       {false, false},
		"a.svc.example.com.evil": {false, false},
	} {
		if got := [2]bool{rules[0].matchesName(name), rules[1].matchesName(name)}; got != want {
			t.Errorf("%s matches %v, want %v", name, got, want)
		}
	}
}

func TestParseEgress(t *testing.T) {
	for _, tc := range []struct {
		rule RuleSpec
		want string
	}{
		{RuleSpec{CIDR: "10.0.0.0/8", Ports: []uint32{0}}, "outside 1..65535"},
		{RuleSpec{CIDR: "10.0.0.1/8"}, "host bits"},
		{RuleSpec{CIDR: "127.0.0.0/8"}, "loopback"},
		{RuleSpec{CIDR: "127.0.0.1/32"}, "loopback"},
		{RuleSpec{CIDR: "fd00::/8"}, "not an IPv4 CIDR"},
		{RuleSpec{CIDR: "nope"}, "not an IPv4 CIDR"},
		{RuleSpec{}, "not an IPv4 CIDR"},
		{RuleSpec{CIDR: "10.0.0.0/8", Ports: []uint32{70000}}, "outside 1..65535"},
		{RuleSpec{CIDR: "10.0.0.0/8", Domain: "a.example.com"}, "both cidr and domain"},
		{RuleSpec{Domain: "*"}, "not a DNS name"},
		{RuleSpec{Domain: "*.*.example.com"}, "not a DNS name"},
		{RuleSpec{Domain: "a.*.example.com"}, "not a DNS name"},
		{RuleSpec{Domain: "*example.com"}, "not a DNS name"},
		{RuleSpec{Domain: "exa mple.com"}, "not a DNS name"},
		{RuleSpec{Domain: "a..com"}, "not a DNS name"},
		{RuleSpec{Domain: strings.Repeat("a.", 130) + "com"}, "not a DNS name"},
	} {
		_, err := ParseEgress("egress", []RuleSpec{tc.rule})
		if apierr.CodeOf(err) != apierr.InvalidRequest || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: err %v, want invalid_request %q", tc.rule, err, tc.want)
		}
	}
	if _, err := ParseEgress("egress", make([]RuleSpec, MaxEgressRules+1)); apierr.CodeOf(err) != apierr.InvalidRequest {
		t.Errorf("too many rules: %v", err)
	}
	r, err := ParseEgress("egress", []RuleSpec{{CIDR: "1.2.3.0/24", Ports: []uint32{443, 80}}, {Domain: "*.Example.COM.", Ports: []uint32{443}}})
	if err != nil || r[0].Ports[0] != 80 || r[0].Ports[1] != 443 || r[1].Domain != "*.example.com" || r[1].Prefix.IsValid() {
		t.Errorf("rules %+v, %v", r, err)
	}
}

func TestParseDNSRecords(t *testing.T) {
	for _, tc := range []struct {
		name, ip, want string
	}{
		{"*.example.com", "192.0.2.1", "not a DNS name"},
		{"", "192.0.2.1", "not a DNS name"},
		{"a.example.com", "::1", "not an IPv4 address"},
		{"a.example.com", "127.0.0.1", "loopback"},
		{"a.example.com", "0.0.0.0", "unspecified"},
		{"a.example.com", "224.0.0.1", "multicast"},
		{"a.example.com", "x", "not an IPv4 address"},
	} {
		_, err := ParseDNSRecords("dnsRecords", []string{tc.name}, []string{tc.ip})
		if apierr.CodeOf(err) != apierr.InvalidRequest || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s %s: err %v, want invalid_request %q", tc.name, tc.ip, err, tc.want)
		}
	}
	if _, err := ParseDNSRecords("dnsRecords", []string{"a.example.com", "A.example.com."}, []string{"192.0.2.1", "192.0.2.1"}); err == nil || !strings.Contains(err.Error(), "twice") {
		t.Errorf("duplicate record: %v", err)
	}
	many := make([]string, MaxDNSRecords+1)
	if _, err := ParseDNSRecords("dnsRecords", many, many); apierr.CodeOf(err) != apierr.InvalidRequest {
		t.Errorf("too many records: %v", err)
	}
	r, err := ParseDNSRecords("dnsRecords", []string{"API.example.com.", "api.example.com"}, []string{"192.0.2.1", "192.0.2.2"})
	if err != nil || len(r) != 2 || r[0].Name != "api.example.com" {
		t.Errorf("records %+v, %v", r, err)
	}
}
