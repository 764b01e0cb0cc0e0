package network

import (
	"context"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
)

// DNSPolicy says which names a network's DNS resolves.
type DNSPolicy int

const (
	// DNSOpen resolves every name: the network's records, then the host's
	// resolver (gvisor-tap-vsock's behaviour, the default).
	DNSOpen DNSPolicy = iota
	// DNSRules resolves only the network's records and names matching a
	// domain egress rule; other lookups are answered REFUSED and counted.
	DNSRules
)

// upstreamTimeout bounds one lookup at the host's resolver.
const upstreamTimeout = 5 * time.Second

// resolver is the host's resolver (a fake in unit tests).
type resolver interface {
	LookupIPAddr(ctx context.Context, host string) ([]net.IPAddr, error)
	LookupCNAME(ctx context.Context, host string) (string, error)
	LookupMX(ctx context.Context, name string) ([]*net.MX, error)
	LookupNS(ctx context.Context, name string) ([]*net.NS, error)
	LookupSRV(ctx context.Context, service, proto, name string) (string, []*net.SRV, error)
	LookupTXT(ctx context.Context, name string) ([]string, error)
}

// hostResolver is what every network asks; tests replace it.
var hostResolver resolver = &net.Resolver{}

// dnsServer is a network's DNS at the gateway, port 53 (UDP and TCP). It
// answers the network's records itself, asks the host's resolver for the
// rest (as gvisor-tap-vsock's did, with TTL 0), refuses what the policy does
// not resolve, and pins the A answers for names that match a domain rule:
// only those addresses does the rule then allow, for this VM.
type dnsServer struct {
	n       *Network
	policy  DNSPolicy
	records map[string][]netip.Addr // name (lower case, no final dot) -> addresses
	servers []*dns.Server
	closers []io.Closer // the UDP socket and TCP listener
}

func (n *Network) startDNS(records []DNSRecord, policy DNSPolicy) error {
	d := &dnsServer{n: n, policy: policy, records: map[string][]netip.Addr{}}
	for _, r := range records {
		d.records[r.Name] = append(d.records[r.Name], r.IP)
	}
	addr := netip.AddrPortFrom(n.plan.Gateway, dnsPort)
	pc, err := n.us.listenUDP(addr)
	if err != nil {
		return err
	}
	ln, err := n.us.listenTCP(addr)
	if err != nil {
		_ = pc.Close()
		return err
	}
	// A VM's TCP connections to the DNS are bounded like its IMDS ones.
	ln = &limitListener{Listener: ln, n: n, max: maxDNSInFlight,
		conns: func(v *vmState) *atomic.Int32 { return &v.dnsConns }, refused: func(v *vmState) { v.dns[dnsBusy].Add(1) }}
	d.closers = []io.Closer{pc, ln}
	d.servers = []*dns.Server{
		{PacketConn: pc, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) { d.serve(w, r, dns.MinMsgSize) })},
		{Listener: ln, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) { d.serve(w, r, dns.MaxMsgSize) })},
	}
	for _, s := range d.servers {
		n.wg.Go(func() {
			if err := s.ActivateAndServe(); err != nil && n.runCtx.Err() == nil {
				n.log.Warn("DNS server stopped", "err", err)
			}
		})
	}
	n.dns = d
	return nil
}

// close stops the servers; closing their sockets also ends one whose
// ActivateAndServe has not started yet (Shutdown refuses that).
func (d *dnsServer) close() {
	for _, s := range d.servers {
		_ = s.Shutdown()
	}
	for _, c := range d.closers {
		_ = c.Close()
	}
}

func (d *dnsServer) serve(w dns.ResponseWriter, r *dns.Msg, size int) {
	m := new(dns.Msg)
	m.SetReply(r)
	m.RecursionAvailable = true
	var peer netip.Addr
	if ap, err := netip.ParseAddrPort(w.RemoteAddr().String()); err == nil {
		peer = ap.Addr().Unmap()
	}
	switch vs := d.n.vmAt(peer); {
	case vs == nil:
		m.Rcode = dns.RcodeRefused
	case len(r.Question) != 1:
		m.Rcode = dns.RcodeFormatError
	default:
		d.answer(vs, m, r.Question[0])
	}
	if opt := r.IsEdns0(); opt != nil && size == dns.MinMsgSize {
		size = max(int(opt.UDPSize()), dns.MinMsgSize)
	}
	m.Truncate(size)
	_ = w.WriteMsg(m)
}

func (d *dnsServer) answer(vs *vmState, m *dns.Msg, q dns.Question) {
	name := strings.TrimSuffix(strings.ToLower(q.Name), ".")
	var rules []int
	for i, r := range d.n.egress.rules {
		if r.matchesName(name) {
			rules = append(rules, i)
		}
	}
	ips, local := d.records[name]
	if d.policy == DNSRules && !local && len(rules) == 0 {
		vs.dns[dnsPolicy].Add(1)
		d.n.log.Debug("DNS lookup refused by the network's policy", "vm", vs.id, "name", name)
		m.Rcode = dns.RcodeRefused
		return
	}
	if local {
		if q.Qtype != dns.TypeA {
			return // the name exists, with no data of that type
		}
	} else {
		if vs.dnsInFlight.Add(1) > maxDNSInFlight {
			vs.dnsInFlight.Add(-1)
			vs.dns[dnsBusy].Add(1)
			m.Rcode = dns.RcodeServerFailure
			return
		}
		defer vs.dnsInFlight.Add(-1)
		ctx, cancel := context.WithTimeout(d.n.runCtx, upstreamTimeout)
		defer cancel()
		if q.Qtype != dns.TypeA {
			upstreamOther(ctx, m, q, dns.Fqdn(name))
			return
		}
		addrs, err := hostResolver.LookupIPAddr(ctx, dns.Fqdn(name))
		if err != nil {
			m.Rcode = dns.RcodeNameError
			return
		}
		for _, a := range addrs {
			if ip, ok := netip.AddrFromSlice(a.IP.To4()); ok {
				ips = append(ips, ip)
			}
		}
	}
	var ttl uint32
	if len(rules) > 0 && len(ips) > 0 {
		if !vs.pin(rules, ips, time.Now()) {
			vs.dns[dnsPins].Add(1)
			m.Rcode = dns.RcodeServerFailure
			return
		}
		ttl = uint32(pinTTL / time.Second)
	} else if local {
		ttl = uint32(pinTTL / time.Second)
	}
	for _, ip := range ips {
		m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: ttl}, A: ip.AsSlice()})
	}
}

// upstreamOther answers the other types gvisor-tap-vsock's DNS answered,
// the same way (TTL 0, NXDOMAIN on any error); AAAA and the rest get an
// empty answer.
func upstreamOther(ctx context.Context, m *dns.Msg, q dns.Question, name string) {
	hdr := func(t uint16) dns.RR_Header { return dns.RR_Header{Name: q.Name, Rrtype: t, Class: dns.ClassINET} }
	var err error
	switch q.Qtype {
	case dns.TypeCNAME:
		var c string
		if c, err = hostResolver.LookupCNAME(ctx, name); err == nil {
			m.Answer = append(m.Answer, &dns.CNAME{Hdr: hdr(dns.TypeCNAME), Target: c})
		}
	case dns.TypeMX:
		var mxs []*net.MX
		mxs, err = hostResolver.LookupMX(ctx, name)
		for _, mx := range mxs {
			m.Answer = append(m.Answer, &dns.MX{Hdr: hdr(dns.TypeMX), Mx: mx.Host, Preference: mx.Pref})
		}
	case dns.TypeNS:
		var nss []*net.NS
		nss, err = hostResolver.LookupNS(ctx, name)
		for _, ns := range nss {
			m.Answer = append(m.Answer, &dns.NS{Hdr: hdr(dns.TypeNS), Ns: ns.Host})
		}
	case dns.TypeSRV:
		var srvs []*net.SRV
		_, srvs, err = hostResolver.LookupSRV(ctx, "", "", name)
		for _, s := range srvs {
			m.Answer = append(m.Answer, &dns.SRV{Hdr: hdr(dns.TypeSRV), Port: s.Port, Priority: s.Priority, Target: s.Target, Weight: s.Weight})
		}
	case dns.TypeTXT:
		var txts []string
		txts, err = hostResolver.LookupTXT(ctx, name)
		for _, t := range txts {
			m.Answer = append(m.Answer, &dns.TXT{Hdr: hdr(dns.TypeTXT), Txt: splitTXT(t)})
		}
	}
	if err != nil {
		m.Answer = nil
		m.Rcode = dns.RcodeNameError
	}
}

// splitTXT cuts a TXT value into the 255-byte strings DNS carries.
func splitTXT(s string) []string {
	var out []string
	for len(s) > 255 {
		out = append(out, s[:255])
		s = s[255:]
	}
	return append(out, s)
}
