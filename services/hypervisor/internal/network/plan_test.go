package network

import (
	"errors"
	"hash/fnv"
	"net/netip"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

func TestPlanFor(t *testing.T) {
	tests := []struct {
		cidr                                  string
		prefix, gw, alias, bcast, first, last string
		pool                                  int
	}{
		{"10.10.0.0/24", "10.10.0.0/24", "10.10.0.1", "10.10.0.254", "10.10.0.255", "10.10.0.2", "10.10.0.253", 252},
		{"10.10.0.77/24", "10.10.0.0/24", "10.10.0.1", "10.10.0.254", "10.10.0.255", "10.10.0.2", "10.10.0.253", 252},
		{"172.20.0.0/16", "172.20.0.0/16", "172.20.0.1", "172.20.255.254", "172.20.255.255", "172.20.0.2", "172.20.255.253", 65532},
		{"192.168.5.8/29", "192.168.5.8/29", "192.168.5.9", "192.168.5.14", "192.168.5.15", "192.168.5.10", "192.168.5.13", 4},
	}
	for _, tc := range tests {
		p, err := PlanFor(tc.cidr)
		if err != nil {
			t.Fatalf("PlanFor(%s): %v", tc.cidr, err)
		}
		got := []string{p.Prefix.String(), p.Gateway.String(), p.HostAlias.String(), p.Broadcast.String(), p.PoolFirst.String(), p.PoolLast.String()}
		want := []string{tc.prefix, tc.gw, tc.alias, tc.bcast, tc.first, tc.last}
		if strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("PlanFor(%s) = %v, want %v", tc.cidr, got, want)
		}
		if p.PoolSize() != tc.pool {
			t.Errorf("PlanFor(%s).PoolSize() = %d, want %d", tc.cidr, p.PoolSize(), tc.pool)
		}
		if p.InPool(p.Gateway) || p.InPool(p.HostAlias) || p.InPool(p.Broadcast) || p.InPool(p.Prefix.Addr()) {
			t.Errorf("PlanFor(%s): reserved address in pool", tc.cidr)
		}
		if !p.InPool(p.PoolFirst) || !p.InPool(p.PoolLast) {
			t.Errorf("PlanFor(%s): pool bounds not in pool", tc.cidr)
		}
	}
}

func TestPlanForRejects(t *testing.T) {
	for _, cidr := range []string{
		"10.0.0.0/30", "10.0.0.0/32", "10.0.0.0/15", "10.0.0.0/8",
		"169.254.0.0/16", "169.254.169.0/24", "169.254.0.0/29", "169.0.0.0/8",
		"fd00::/64", "10.0.0.0", "", "10.0.0.0/33", "bogus/24",
	} {
		_, err := PlanFor(cidr)
		if err == nil {
			t.Errorf("PlanFor(%q) succeeded", cidr)
			continue
		}
		if !errors.Is(err, apierr.ErrInvalid) {
			t.Errorf("PlanFor(%q): error %v is not invalid_request", cidr, err)
		}
	}
	// Adjacent to link-local but not overlapping.
	for _, cidr := range []string{"169.253.0.0/16", "169.255.0.0/16"} {
		if _, err := PlanFor(cidr); err != nil {
			t.Errorf("PlanFor(%q): %v", cidr, err)
		}
	}
}

func TestValidate(t *testing.T) {
	good := []Spec{
		{Name: "default", CIDR: "10.0.0.0/24"},
		{Name: "a", CIDR: "10.0.0.0/16"},
		{Name: "net-1", CIDR: "10.0.0.0/29", DNSSearchDomain: "vm.internal"},
		{Name: strings.Repeat("a", 63), CIDR: "10.0.0.0/24"},
	}
	for _, s := range good {
		if err := Validate(s); err != nil {
			t.Errorf("Validate(%+v): %v", s, err)
		}
	}
	bad := []Spec{
		{Name: "", CIDR: "10.0.0.0/24"},
		{Name: "Default", CIDR: "10.0.0.0/24"},
		{Name: "-net", CIDR: "10.0.0.0/24"},
		{Name: "net-", CIDR: "10.0.0.0/24"},
		{Name: "net_1", CIDR: "10.0.0.0/24"},
		{Name: "net.1", CIDR: "10.0.0.0/24"},
		{Name: strings.Repeat("a", 64), CIDR: "10.0.0.0/24"},
		{Name: "net", CIDR: "10.0.0.0/30"},
		{Name: "net", CIDR: "10.0.0.0/15"},
		{Name: "net", CIDR: "169.254.0.0/16"},
		{Name: "net", CIDR: "10.0.0.0/24", DNSSearchDomain: "bad domain"},
	}
	for _, s := range bad {
		err := Validate(s)
		if !errors.Is(err, apierr.ErrInvalid) {
			t.Errorf("Validate(%+v) = %v, want invalid_request", s, err)
		}
	}
}

func TestMAC(t *testing.T) {
	h := fnv.New32a()
	h.Write([]byte("default"))
	lb := byte(h.Sum32())
	tests := []struct {
		network, ip string
		want        string
	}{
		{"default", "10.0.0.2", macWith(lb, "0a:00:00:02")},
		{"default", "192.168.255.253", macWith(lb, "c0:a8:ff:fd")},
		{"default", "::ffff:10.0.0.2", macWith(lb, "0a:00:00:02")},
	}
	for _, tc := range tests {
		if got := MAC(tc.network, netip.MustParseAddr(tc.ip)); got != tc.want {
			t.Errorf("MAC(%s, %s) = %s, want %s", tc.network, tc.ip, got, tc.want)
		}
	}
	// Known value: fnv32a("") = 0x811c9dc5, low byte c5.
	if got := MAC("", netip.MustParseAddr("10.1.2.3")); got != "02:c5:0a:01:02:03" {
		t.Errorf("MAC(\"\", 10.1.2.3) = %s", got)
	}
	// Every pool address of a /24 has a distinct MAC.
	p, _ := PlanFor("10.0.0.0/24")
	seen := map[string]bool{}
	for ip := p.PoolFirst; ip.Compare(p.PoolLast) <= 0; ip = ip.Next() {
		m := MAC("x", ip)
		if seen[m] || m == GatewayMAC || !strings.HasPrefix(m, "02:") || len(m) != 17 {
			t.Fatalf("bad MAC %s for %s", m, ip)
		}
		seen[m] = true
	}
}

func macWith(lb byte, rest string) string {
	const hex = "0123456789abcdef"
	return "02:" + string([]byte{hex[lb>>4], hex[lb&15]}) + ":" + rest
}
