package network

import (
	"encoding/binary"
	"net/netip"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/gen/apierr"
)

func tcpTo(dst string, port uint16) []byte {
	seg := make([]byte, 20)
	binary.BigEndian.PutUint16(seg[0:2], 40000)
	binary.BigEndian.PutUint16(seg[2:4], port)
	return ipv4Packet(netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr(dst), protoTCP, 0, 0, seg)
}

func TestEgressPolicy(t *testing.T) {
	local := netip.MustParsePrefix("10.1.0.0/24")
	def := egressPolicy{local: local}
	rules, err := ParseEgress("egress", []string{"192.168.7.0/24", "93.184.0.0/16"}, [][]uint32{{443, 80}, nil})
	if err != nil {
		t.Fatal(err)
	}
	allow := egressPolicy{local: local, rules: rules}
	icmp := ipv4Packet(netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("192.168.7.9"), 1, 0, 0, make([]byte, 8))
	frag := ipv4Packet(netip.MustParseAddr("10.1.0.5"), netip.MustParseAddr("192.168.7.9"), protoTCP, 0, 0x0010, make([]byte, 8))
	for _, tc := range []struct {
		name   string
		policy egressPolicy
		pkt    []byte
		want   bool
		reason string
	}{
		{"default: own network", def, tcpTo("10.1.0.1", 53), true, ""},
		{"default: IMDS", def, tcpTo("169.254.169.254", 80), true, ""},
		{"default: public", def, tcpTo("93.184.216.34", 443), true, ""},
		{"default: other private", def, tcpTo("10.2.0.1", 22), false, "blocked by default"},
		{"default: host LAN", def, tcpTo("192.168.1.1", 80), false, "192.168.0.0/16"},
		{"default: link-local", def, tcpTo("169.254.1.1", 80), false, "169.254.0.0/16"},
		{"default: shared", def, tcpTo("100.64.0.1", 80), false, "blocked by default"},
		{"default: broadcast", def, ipv4Packet(netip.MustParseAddr("10.1.0.5"), broadcast, protoUDP, 0, 0, udpDatagram(68, 67, nil)), true, ""},
		{"rules: allowed port", allow, tcpTo("192.168.7.9", 443), true, ""},
		{"rules: other port", allow, tcpTo("192.168.7.9", 22), false, "port 22 is not allowed"},
		{"rules: portless rule", allow, tcpTo("93.184.216.34", 8443), true, ""},
		{"rules: public not listed", allow, tcpTo("8.8.8.8", 443), false, "not allowed by the network's rules"},
		{"rules: own network", allow, tcpTo("10.1.0.9", 22), true, ""},
		{"rules: ICMP to a ported rule", allow, icmp, false, "not allowed"},
		{"rules: fragment to a ported rule", allow, frag, false, "not allowed"},
		{"everything: still no loopback", egressPolicy{local: local, rules: []EgressRule{{Prefix: netip.MustParsePrefix("0.0.0.0/0")}}}, tcpTo("127.0.0.1", 8080), false, "loopback"},
		{"everything: private", egressPolicy{local: local, rules: []EgressRule{{Prefix: netip.MustParsePrefix("0.0.0.0/0")}}}, tcpTo("10.9.9.9", 8080), true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ok, reason := tc.policy.permit(tc.pkt, int(tc.pkt[0]&0x0f)*4)
			if ok != tc.want || !strings.Contains(reason, tc.reason) {
				t.Errorf("permit = %v %q, want %v %q", ok, reason, tc.want, tc.reason)
			}
		})
	}
}

func TestParseEgress(t *testing.T) {
	for _, tc := range []struct {
		cidrs []string
		ports [][]uint32
		want  string
	}{
		{[]string{"10.0.0.0/8"}, [][]uint32{{0}}, "outside 1..65535"},
		{[]string{"10.0.0.1/8"}, [][]uint32{nil}, "host bits"},
		{[]string{"127.0.0.0/8"}, [][]uint32{nil}, "loopback"},
		{[]string{"127.0.0.1/32"}, [][]uint32{nil}, "loopback"},
		{[]string{"fd00::/8"}, [][]uint32{nil}, "not an IPv4 CIDR"},
		{[]string{"nope"}, [][]uint32{nil}, "not an IPv4 CIDR"},
		{[]string{"10.0.0.0/8"}, [][]uint32{{70000}}, "outside 1..65535"},
	} {
		_, err := ParseEgress("egress", tc.cidrs, tc.ports)
		if apierr.CodeOf(err) != apierr.InvalidRequest || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v %v: err %v, want invalid_request %q", tc.cidrs, tc.ports, err, tc.want)
		}
	}
	many := make([]string, MaxEgressRules+1)
	if _, err := ParseEgress("egress", many, make([][]uint32, len(many))); apierr.CodeOf(err) != apierr.InvalidRequest {
		t.Errorf("too many rules: %v", err)
	}
	r, err := ParseEgress("egress", []string{"1.2.3.0/24"}, [][]uint32{{443, 80}})
	if err != nil || r[0].Ports[0] != 80 || r[0].Ports[1] != 443 {
		t.Errorf("rules %v, %v", r, err)
	}
}
