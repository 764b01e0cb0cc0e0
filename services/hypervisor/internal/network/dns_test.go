package network

import (
	"context"
	"errors"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// fakeResolver stands in for the host's resolver: names map to addresses;
// block, if set, holds every lookup until it is closed.
type fakeResolver struct {
	names   map[string][]net.IPAddr
	block   chan struct{}
	lookups atomic.Int32
}

func (f *fakeResolver) LookupIPAddr(ctx context.Context, host string) ([]net.IPAddr, error) {
	f.lookups.Add(1)
	if f.block != nil {
		select {
		case <-f.block:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if a, ok := f.names[host]; ok {
		return a, nil
	}
	return nil, errors.New("no such host")
}
func (f *fakeResolver) LookupCNAME(context.Context, string) (string, error) {
	return "", errors.New("no")
}
func (f *fakeResolver) LookupMX(context.Context, string) ([]*net.MX, error) {
	return nil, errors.New("no")
}
func (f *fakeResolver) LookupNS(context.Context, string) ([]*net.NS, error) {
	return nil, errors.New("no")
}
func (f *fakeResolver) LookupSRV(context.Context, string, string, string) (string, []*net.SRV, error) {
	return "", nil, errors.New("no")
}
func (f *fakeResolver) LookupTXT(_ context.Context, name string) ([]string, error) {
	if name == "txt.example.com." {
		return []string{"hello"}, nil
	}
	return nil, errors.New("no")
}

func useResolver(t *testing.T, r resolver) {
	old := hostResolver
	hostResolver = r
	t.Cleanup(func() { hostResolver = old })
}

// query asks the network's DNS (at gw) from the guest over UDP.
func (g *fakeGuest) query(gw netip.Addr, name string, qtype uint16) *dns.Msg {
	g.t.Helper()
	c := g.dialUDP(netip.AddrPortFrom(gw, 53))
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(name), qtype)
	b, _ := m.Pack()
	if _, err := c.Write(b); err != nil {
		g.t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 4096)
	k, err := c.Read(buf)
	if err != nil {
		g.t.Fatalf("query %s: %v", name, err)
	}
	r := new(dns.Msg)
	if err := r.Unpack(buf[:k]); err != nil {
		g.t.Fatal(err)
	}
	return r
}

func answers(m *dns.Msg) (ips []string, ttl uint32) {
	for _, rr := range m.Answer {
		if a, ok := rr.(*dns.A); ok {
			ips, ttl = append(ips, a.A.String()), a.Hdr.Ttl
		}
	}
	return ips, ttl
}

// A domain rule allows only what the network's DNS answered for a matching
// name, to that VM; with dns_policy rules other names are refused; the
// network's records are answered in either mode.
func TestDNSRulesAndPins(t *testing.T) {
	ip := hostAddr(t)
	h := serveHost(t, ip)
	other := serveHost(t, ip) // same address, a port no rule names
	up := &fakeResolver{names: map[string][]net.IPAddr{
		"api.example.com.": {{IP: net.IP(ip.AsSlice())}},
		"x.svc.test.":      {{IP: net.IP(ip.AsSlice())}},
		"elsewhere.org.":   {{IP: net.IP(ip.AsSlice())}},
	}}
	useResolver(t, up)
	rules := mustRules(t,
		RuleSpec{Domain: "api.example.com", Ports: []uint32{uint32(h.addr.Port())}},
		RuleSpec{Domain: "*.svc.test"})
	records, err := ParseDNSRecords("dnsRecords", []string{"static.test"}, []string{"192.0.2.77"})
	if err != nil {
		t.Fatal(err)
	}
	n := startTest(t, Spec{Name: "dns", CIDR: "10.82.0.0/24", Egress: rules, DNSRecords: records, DNSPolicy: DNSRules}, nil, nil)
	a, _ := guestOn(t, n, "a")
	b, _ := guestOn(t, n, "b")
	gw := n.plan.Gateway

	// Before any answer the address is not allowed, whatever the rules say.
	if c, err := a.dialTCP(h.addr, time.Second); err == nil {
		c.Close()
		t.Fatal("reached the domain's address before the DNS answered it")
	}
	if got := n.VMStats("a").EgressDropped["rule"]; got == 0 {
		t.Fatal("the dropped SYN was not counted")
	}

	r := a.query(gw, "API.example.com", dns.TypeA)
	if ips, ttl := answers(r); r.Rcode != dns.RcodeSuccess || len(ips) != 1 || ips[0] != ip.String() || ttl != 60 {
		t.Fatalf("api.example.com: %v", r)
	}
	c, err := a.dialTCP(h.addr, 5*time.Second)
	if err != nil {
		t.Fatalf("the answered address on the rule's port: %v", err)
	}
	c.Close()
	// The rule's port only, and only for the VM that asked.
	if c, err := a.dialTCP(other.addr, time.Second); err == nil {
		c.Close()
		t.Fatal("another port of the answered address was reached")
	}
	if c, err := b.dialTCP(h.addr, time.Second); err == nil {
		c.Close()
		t.Fatal("b reached the address a's lookup pinned")
	}

	// Wildcards: names below, any port.
	if ips, _ := answers(a.query(gw, "x.svc.test", dns.TypeA)); len(ips) != 1 {
		t.Fatalf("x.svc.test: %v", ips)
	}
	if c, err := a.dialTCP(other.addr, 5*time.Second); err != nil {
		t.Fatalf("the wildcard rule's address, any port: %v", err)
	} else {
		c.Close()
	}

	// Policy rules: other names are refused and counted, without asking
	// the host; the records are answered.
	before := up.lookups.Load()
	if r := a.query(gw, "elsewhere.org", dns.TypeA); r.Rcode != dns.RcodeRefused {
		t.Fatalf("elsewhere.org under dns_policy rules: %v", r)
	}
	if r := a.query(gw, "svc.test", dns.TypeA); r.Rcode != dns.RcodeRefused {
		t.Fatalf("the wildcard's apex: %v", r)
	}
	if up.lookups.Load() != before {
		t.Fatal("a refused name reached the host's resolver")
	}
	if got := n.VMStats("a").DNSRefused["policy"]; got != 2 {
		t.Fatalf("refused lookups counted %d, want 2", got)
	}
	if ips, ttl := answers(a.query(gw, "static.test", dns.TypeA)); len(ips) != 1 || ips[0] != "192.0.2.77" || ttl != 60 {
		t.Fatalf("static.test: %v %d", ips, ttl)
	}
	if r := a.query(gw, "static.test", dns.TypeAAAA); r.Rcode != dns.RcodeSuccess || len(r.Answer) != 0 {
		t.Fatalf("static.test AAAA: %v", r)
	}
}

// Without rules the DNS is gvisor-tap-vsock's: every name through the
// host's resolver, TTL 0; a VM's lookups in flight are bounded.
func TestDNSOpenAndBusy(t *testing.T) {
	up := &fakeResolver{names: map[string][]net.IPAddr{"elsewhere.org.": {{IP: net.ParseIP("192.0.2.5")}}}}
	useResolver(t, up)
	n := startTest(t, Spec{Name: "open", CIDR: "10.83.0.0/24"}, nil, nil)
	a, _ := guestOn(t, n, "a")
	gw := n.plan.Gateway
	if ips, ttl := answers(a.query(gw, "elsewhere.org", dns.TypeA)); len(ips) != 1 || ttl != 0 {
		t.Fatalf("elsewhere.org: %v ttl %d", ips, ttl)
	}
	if r := a.query(gw, "nowhere.org", dns.TypeA); r.Rcode != dns.RcodeNameError {
		t.Fatalf("nowhere.org: %v", r)
	}
	if r := a.query(gw, "txt.example.com", dns.TypeTXT); len(r.Answer) != 1 {
		t.Fatalf("TXT: %v", r)
	}

	up.block = make(chan struct{})
	defer close(up.block)
	before := up.lookups.Load()
	for i := range maxDNSInFlight {
		c := a.dialUDP(netip.AddrPortFrom(gw, 53))
		m := new(dns.Msg)
		m.SetQuestion(dns.Fqdn("elsewhere.org"), dns.TypeA)
		m.Id = uint16(i)
		b, _ := m.Pack()
		_, _ = c.Write(b)
	}
	poll.Until(t, "lookups in flight", func() bool { return up.lookups.Load() == before+maxDNSInFlight })
	if r := a.query(gw, "elsewhere.org", dns.TypeA); r.Rcode != dns.RcodeServerFailure {
		t.Fatalf("a lookup over the bound: %v", r)
	}
	if got := n.VMStats("a").DNSRefused["busy"]; got != 1 {
		t.Fatalf("busy counted %d", got)
	}
}
