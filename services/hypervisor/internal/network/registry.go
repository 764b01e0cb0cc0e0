package network

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// Store persists network records (spec, gateway, leases).
type Store interface {
	ListNetworks() ([]*hypervisorv1.Network, error)
	PutNetwork(n *hypervisorv1.Network) error
	DeleteNetwork(name string) error
}

// Registry is the host's networks: their records, the running userspace
// stacks, and the leases VMs hold on them. A network's IMDS comes from the
// factory it is given, so the registry knows nothing of VMs.
type Registry struct {
	ctx      context.Context
	store    Store
	imds     func(network string) http.Handler
	attached Attached
	max      int // networks on this host (--max-networks)
	limits   Limits
	log      *slog.Logger
	refused  atomic.Uint64 // creates refused at max

	mu   sync.Mutex
	nets map[string]*entry // nil value: being created
}

type entry struct {
	rec *hypervisorv1.Network
	run *Network
}

// Attached names a VM attached to a network, if any: the VM records are
// not the registry's, and a network with a VM on it is not deleted.
type Attached func(network string) (vmID string, ok bool)

// NewRegistry returns an empty registry; Restore starts the stored networks.
// The networks run until ctx ends or Close; limits apply to each (one
// Limits.Host budget to all of them). A create beyond maxNetworks is refused.
func NewRegistry(ctx context.Context, st Store, imds func(network string) http.Handler, attached Attached, maxNetworks int, limits Limits, log *slog.Logger) *Registry {
	return &Registry{ctx: ctx, store: st, imds: imds, attached: attached, max: maxNetworks, limits: limits, log: log, nets: map[string]*entry{}}
}

// Refused counts the creates refused because the host had maxNetworks.
func (r *Registry) Refused() uint64 { return r.refused.Load() }

// full refuses a create when the host has its maximum of networks (being
// created included); called with r.mu held.
func (r *Registry) full() error {
	if n := len(r.nets); r.max > 0 && n >= r.max {
		r.refused.Add(1)
		return apierr.Errorf(apierr.ResourceExhausted, "this host has %d networks, the maximum is %d (--max-networks): delete one first", n, r.max)
	}
	return nil
}

// Restore starts the persisted networks with their leases, and creates the
// default network (defaultName from defaultSubnet) when it is missing;
// defaultName empty creates none.
func (r *Registry) Restore(defaultName, defaultSubnet string) error {
	recs, err := r.store.ListNetworks()
	if err != nil {
		return fmt.Errorf("load networks: %w", err)
	}
	for _, rec := range recs {
		leases := map[string]netip.Addr{}
		for _, l := range rec.GetLeases() {
			if ip, err := netip.ParseAddr(l.GetIp()); err == nil {
				leases[l.GetVmId()] = ip
			}
		}
		if err := r.run(rec, leases); err != nil {
			return fmt.Errorf("network %s: %w", rec.GetSpec().GetName(), err)
		}
	}
	if defaultName == "" {
		return nil
	}
	r.mu.Lock()
	_, ok := r.nets[defaultName]
	r.mu.Unlock()
	if !ok {
		if _, err := r.Create(&hypervisorv1.CreateNetworkRequest{Name: defaultName, Cidr: defaultSubnet}, ""); err != nil {
			return fmt.Errorf("default network: %w", err)
		}
	}
	return nil
}

func (r *Registry) run(rec *hypervisorv1.Network, leases map[string]netip.Addr) error {
	spec, err := specOf(rec.GetSpec().GetName(), rec.GetSpec().GetCidr(), rec.GetSpec().GetDnsSearchDomain(), rec.GetSpec())
	if err != nil {
		return err
	}
	run, err := Start(r.ctx, spec, leases, r.imds(spec.Name), r.limits, r.log)
	if err != nil {
		return err
	}
	if rec.GetSpec().GetDnsPolicy() == hypervisorv1.DnsPolicy_DNS_POLICY_UNSPECIFIED {
		rec.GetSpec().DnsPolicy = hypervisorv1.DnsPolicy_DNS_POLICY_OPEN // stored before the field existed
	}
	r.mu.Lock()
	r.nets[spec.Name] = &entry{rec: rec, run: run}
	r.mu.Unlock()
	return nil
}

// specSource is what a request and a stored spec have in common.
type specSource interface {
	GetEgress() []*hypervisorv1.EgressRule
	GetDnsRecords() []*hypervisorv1.DnsRecord
	GetDnsPolicy() hypervisorv1.DnsPolicy
}

// specOf validates the API's network fields into a Spec.
func specOf(name, cidr, search string, src specSource) (Spec, error) {
	spec := Spec{Name: name, CIDR: cidr, DNSSearchDomain: search}
	if err := Validate(spec); err != nil {
		return Spec{}, err
	}
	var rules []RuleSpec
	for _, r := range src.GetEgress() {
		rules = append(rules, RuleSpec{CIDR: r.GetCidr(), Domain: r.GetDomain(), Ports: r.GetPorts()})
	}
	var err error
	if spec.Egress, err = ParseEgress("egress", rules); err != nil {
		return Spec{}, err
	}
	var names, ips []string
	for _, d := range src.GetDnsRecords() {
		names, ips = append(names, d.GetName()), append(ips, d.GetIp())
	}
	if spec.DNSRecords, err = ParseDNSRecords("dnsRecords", names, ips); err != nil {
		return Spec{}, err
	}
	switch p := src.GetDnsPolicy(); p {
	case hypervisorv1.DnsPolicy_DNS_POLICY_UNSPECIFIED, hypervisorv1.DnsPolicy_DNS_POLICY_OPEN:
		spec.DNSPolicy = DNSOpen
	case hypervisorv1.DnsPolicy_DNS_POLICY_RULES:
		spec.DNSPolicy = DNSRules
	default:
		return Spec{}, apierr.Invalidf("dnsPolicy", "unknown DNS policy %d: want open or rules", p)
	}
	return spec, nil
}

// specRecord is the normalised form of a Spec kept in the network record.
func specRecord(s Spec, plan Plan) *hypervisorv1.NetworkSpec {
	out := &hypervisorv1.NetworkSpec{Name: s.Name, Cidr: plan.Prefix.String(), GatewayIp: plan.Gateway.String(),
		DnsSearchDomain: s.DNSSearchDomain, EnableImds: true, DnsPolicy: hypervisorv1.DnsPolicy_DNS_POLICY_OPEN}
	if s.DNSPolicy == DNSRules {
		out.DnsPolicy = hypervisorv1.DnsPolicy_DNS_POLICY_RULES
	}
	for _, r := range s.Egress {
		er := &hypervisorv1.EgressRule{Domain: r.Domain}
		if r.Domain == "" {
			er.Cidr = r.Prefix.String()
		}
		for _, p := range r.Ports {
			er.Ports = append(er.Ports, uint32(p))
		}
		out.Egress = append(out.Egress, er)
	}
	for _, d := range s.DNSRecords {
		out.DnsRecords = append(out.DnsRecords, &hypervisorv1.DnsRecord{Name: d.Name, Ip: d.IP.String()})
	}
	return out
}

// Create validates and starts a network; IMDS is always on and the host
// alias always off for networks the API creates.
func (r *Registry) Create(req *hypervisorv1.CreateNetworkRequest, createdBy string) (*hypervisorv1.Network, error) {
	r.mu.Lock()
	full := r.full()
	r.mu.Unlock()
	if full != nil {
		return nil, full // before validating, as the bound always was
	}
	spec, err := specOf(req.GetName(), req.GetCidr(), req.GetDnsSearchDomain(), req)
	if err != nil {
		return nil, err
	}
	plan, err := PlanFor(spec.CIDR)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	if _, exists := r.nets[spec.Name]; exists {
		r.mu.Unlock()
		return nil, apierr.Errorf(apierr.Conflict, "network %q exists", spec.Name)
	}
	if err := r.full(); err != nil { // a create that started meanwhile
		r.mu.Unlock()
		return nil, err
	}
	r.nets[spec.Name] = nil // reserved while it starts
	r.mu.Unlock()
	rec := &hypervisorv1.Network{
		Spec:      specRecord(spec, plan),
		Gateway:   plan.Gateway.String(),
		CreatedBy: createdBy,
	}
	err = r.store.PutNetwork(rec)
	if err == nil {
		err = r.run(rec, nil)
	}
	if err != nil {
		r.mu.Lock()
		delete(r.nets, spec.Name)
		r.mu.Unlock()
		_ = r.store.DeleteNetwork(spec.Name)
		return nil, err
	}
	r.log.Info("network created", "network", spec.Name, "cidr", rec.GetSpec().GetCidr())
	return r.Get(spec.Name)
}

// Get returns a network with its leases, sorted by IP.
func (r *Registry) Get(name string) (*hypervisorv1.Network, error) {
	r.mu.Lock()
	e := r.nets[name]
	r.mu.Unlock()
	if e == nil {
		return nil, apierr.Errorf(apierr.NotFound, "network %q not found", name)
	}
	return e.record(), nil
}

func (e *entry) record() *hypervisorv1.Network {
	out := &hypervisorv1.Network{Spec: e.rec.GetSpec(), Gateway: e.rec.GetGateway(), CreatedBy: e.rec.GetCreatedBy()}
	name := e.rec.GetSpec().GetName()
	for id, ip := range e.run.Leases() {
		out.Leases = append(out.Leases, &hypervisorv1.Lease{VmId: id, Ip: ip.String(), Mac: MAC(name, ip)})
	}
	sort.Slice(out.Leases, func(i, j int) bool {
		a, _ := netip.ParseAddr(out.Leases[i].GetIp())
		b, _ := netip.ParseAddr(out.Leases[j].GetIp())
		return a.Less(b)
	})
	return out
}

// List returns every network, sorted by name.
func (r *Registry) List() []*hypervisorv1.Network {
	var out []*hypervisorv1.Network
	for _, e := range r.entries() {
		out = append(out, e.record())
	}
	slices.SortFunc(out, func(a, b *hypervisorv1.Network) int {
		return strings.Compare(a.GetSpec().GetName(), b.GetSpec().GetName())
	})
	return out
}

func (r *Registry) entries() []*entry {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]*entry, 0, len(r.nets))
	for _, e := range r.nets {
		if e != nil {
			out = append(out, e)
		}
	}
	return out
}

// Delete stops a network; attached says which VM, if any, still uses it
// (the network is not deleted then).
func (r *Registry) Delete(name string) error {
	r.mu.Lock()
	e := r.nets[name]
	if e == nil {
		r.mu.Unlock()
		return apierr.Errorf(apierr.NotFound, "network %q not found", name)
	}
	if id, ok := r.attached(name); ok {
		r.mu.Unlock()
		return apierr.Errorf(apierr.Conflict, "network %q has vm %s attached; delete the vm first", name, id)
	}
	delete(r.nets, name)
	r.mu.Unlock()
	if err := e.run.Close(); err != nil {
		r.log.Warn("close network", "network", name, "error", err)
	}
	return r.store.DeleteNetwork(name)
}

// Running returns a running network, nil when there is none of that name.
func (r *Registry) Running(name string) *Network {
	r.mu.Lock()
	defer r.mu.Unlock()
	if e := r.nets[name]; e != nil {
		return e.run
	}
	return nil
}

// Attach gives a VM an address on a network and persists the lease.
func (r *Registry) Attach(network, vmID string) (ip netip.Addr, mac string, err error) {
	r.mu.Lock()
	e := r.nets[network]
	r.mu.Unlock()
	if e == nil {
		return netip.Addr{}, "", apierr.Invalidf("network", "network %q not found", network)
	}
	ip, mac, err = e.run.Allocate(vmID)
	if err != nil {
		return netip.Addr{}, "", err
	}
	return ip, mac, r.store.PutNetwork(e.record())
}

// Detach releases a VM's lease.
func (r *Registry) Detach(network, vmID string) {
	r.mu.Lock()
	e := r.nets[network]
	r.mu.Unlock()
	if e == nil {
		return
	}
	e.run.Release(vmID)
	if err := r.store.PutNetwork(e.record()); err != nil {
		r.log.Error("persist leases", "network", network, "error", err)
	}
}

// ReleaseUnknown releases every lease held by a VM known says nothing of
// (a create or delete a restart cut short), and returns how many it released.
func (r *Registry) ReleaseUnknown(known func(vmID string) bool) int {
	released := 0
	for _, e := range r.entries() {
		n := 0
		for id, ip := range e.run.Leases() {
			if !known(id) {
				r.log.Warn("releasing the lease of a vm without a record (a create or delete cut short)", "network", e.rec.GetSpec().GetName(), "vm", id, "ip", ip)
				e.run.Release(id)
				n++
			}
		}
		if n > 0 {
			if err := r.store.PutNetwork(e.record()); err != nil {
				r.log.Error("persist leases", "network", e.rec.GetSpec().GetName(), "error", err)
			}
		}
		released += n
	}
	return released
}

// Close stops every network.
func (r *Registry) Close() {
	for _, e := range r.entries() {
		if err := e.run.Close(); err != nil {
			r.log.Warn("close network", "network", e.rec.GetSpec().GetName(), "error", err)
		}
	}
}
