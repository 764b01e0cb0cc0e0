package vm

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"sort"

	"github.com/giantswarm/vm-manager/gen/apierr"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/network"
)

// netState is one running network.
type netState struct {
	rec *hypervisorv1.Network
	run *network.Network
}

// startNetworks restores the persisted networks with their leases and
// creates the default network when it is missing.
func (m *Manager) startNetworks() error {
	recs, err := m.store.ListNetworks()
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
		if err := m.runNetwork(rec, leases); err != nil {
			return fmt.Errorf("network %s: %w", rec.GetSpec().GetName(), err)
		}
	}
	if name := m.cfg.DefaultNetwork; name != "" {
		m.mu.Lock()
		_, ok := m.networks[name]
		m.mu.Unlock()
		if !ok {
			if _, err := m.CreateNetwork(context.Background(), &hypervisorv1.CreateNetworkRequest{Name: name, Cidr: m.cfg.DefaultSubnet}, ""); err != nil {
				return fmt.Errorf("default network: %w", err)
			}
		}
	}
	return nil
}

func (m *Manager) runNetwork(rec *hypervisorv1.Network, leases map[string]netip.Addr) error {
	name := rec.GetSpec().GetName()
	handler := imds.New(netVMs{Manager: m, network: name}, m.log.With("network", name))
	egress, err := egressRules(rec.GetSpec().GetEgress())
	if err != nil {
		return err
	}
	run, err := network.Start(m.ctx, network.Spec{Name: name, CIDR: rec.GetSpec().GetCidr(), DNSSearchDomain: rec.GetSpec().GetDnsSearchDomain(), Egress: egress}, leases, handler, m.log.With("network", name))
	if err != nil {
		return err
	}
	m.mu.Lock()
	m.networks[name] = &netState{rec: rec, run: run}
	m.mu.Unlock()
	return nil
}

// netVMs is the IMDS view of one network: addresses may repeat across
// networks, so a caller is looked up among this network's VMs only.
type netVMs struct {
	*Manager
	network string
}

func (n netVMs) ByIP(ip netip.Addr) (*hypervisorv1.VirtualMachine, bool) {
	rec, ok := n.Manager.ByIPIn(n.network, ip)
	return rec, ok
}

// egressRules validates the API's egress rules (empty: the default policy).
func egressRules(in []*hypervisorv1.EgressRule) ([]network.EgressRule, error) {
	cidrs := make([]string, len(in))
	ports := make([][]uint32, len(in))
	for i, r := range in {
		cidrs[i], ports[i] = r.GetCidr(), r.GetPorts()
	}
	return network.ParseEgress("egress", cidrs, ports)
}

// egressRecord is the normalised form kept in the network record.
func egressRecord(rules []network.EgressRule) []*hypervisorv1.EgressRule {
	var out []*hypervisorv1.EgressRule
	for _, r := range rules {
		er := &hypervisorv1.EgressRule{Cidr: r.Prefix.String()}
		for _, p := range r.Ports {
			er.Ports = append(er.Ports, uint32(p))
		}
		out = append(out, er)
	}
	return out
}

// CreateNetwork validates and starts a network; IMDS is always on and the
// host alias always off for networks the API creates.
func (m *Manager) CreateNetwork(_ context.Context, req *hypervisorv1.CreateNetworkRequest, createdBy string) (*hypervisorv1.Network, error) {
	spec := network.Spec{Name: req.GetName(), CIDR: req.GetCidr(), DNSSearchDomain: req.GetDnsSearchDomain()}
	if err := network.Validate(spec); err != nil {
		return nil, err
	}
	egress, err := egressRules(req.GetEgress())
	if err != nil {
		return nil, err
	}
	plan, err := network.PlanFor(spec.CIDR)
	if err != nil {
		return nil, err
	}
	m.mu.Lock()
	if _, exists := m.networks[spec.Name]; exists {
		m.mu.Unlock()
		return nil, apierr.Errorf(apierr.Conflict, "network %q exists", spec.Name)
	}
	m.networks[spec.Name] = nil // reserved while it starts
	m.mu.Unlock()
	rec := &hypervisorv1.Network{
		Spec: &hypervisorv1.NetworkSpec{Name: spec.Name, Cidr: plan.Prefix.String(), GatewayIp: plan.Gateway.String(),
			DnsSearchDomain: spec.DNSSearchDomain, EnableImds: true, Egress: egressRecord(egress)},
		Gateway:   plan.Gateway.String(),
		CreatedBy: createdBy,
	}
	err = m.store.PutNetwork(rec)
	if err == nil {
		err = m.runNetwork(rec, nil)
	}
	if err != nil {
		m.mu.Lock()
		delete(m.networks, spec.Name)
		m.mu.Unlock()
		_ = m.store.DeleteNetwork(spec.Name)
		return nil, err
	}
	m.log.Info("network created", "network", spec.Name, "cidr", rec.GetSpec().GetCidr())
	return m.GetNetwork(spec.Name)
}

// GetNetwork returns a network with its leases, sorted by IP.
func (m *Manager) GetNetwork(name string) (*hypervisorv1.Network, error) {
	m.mu.Lock()
	ns := m.networks[name]
	m.mu.Unlock()
	if ns == nil {
		return nil, apierr.Errorf(apierr.NotFound, "network %q not found", name)
	}
	return m.networkRecord(ns), nil
}

func (m *Manager) networkRecord(ns *netState) *hypervisorv1.Network {
	out := &hypervisorv1.Network{Spec: ns.rec.GetSpec(), Gateway: ns.rec.GetGateway(), CreatedBy: ns.rec.GetCreatedBy()}
	name := ns.rec.GetSpec().GetName()
	for id, ip := range ns.run.Leases() {
		out.Leases = append(out.Leases, &hypervisorv1.Lease{VmId: id, Ip: ip.String(), Mac: network.MAC(name, ip)})
	}
	sort.Slice(out.Leases, func(i, j int) bool {
		a, _ := netip.ParseAddr(out.Leases[i].GetIp())
		b, _ := netip.ParseAddr(out.Leases[j].GetIp())
		return a.Less(b)
	})
	return out
}

// ListNetworks returns every network, sorted by name.
func (m *Manager) ListNetworks() []*hypervisorv1.Network {
	m.mu.Lock()
	var all []*netState
	for _, ns := range m.networks {
		if ns != nil {
			all = append(all, ns)
		}
	}
	m.mu.Unlock()
	out := make([]*hypervisorv1.Network, 0, len(all))
	for _, ns := range all {
		out = append(out, m.networkRecord(ns))
	}
	slices.SortFunc(out, func(a, b *hypervisorv1.Network) int {
		return compareStrings(a.GetSpec().GetName(), b.GetSpec().GetName())
	})
	return out
}

// DeleteNetwork stops a network no VM is attached to.
func (m *Manager) DeleteNetwork(_ context.Context, name string) error {
	m.mu.Lock()
	ns := m.networks[name]
	if ns == nil {
		m.mu.Unlock()
		return apierr.Errorf(apierr.NotFound, "network %q not found", name)
	}
	for _, mc := range m.machines {
		mc.mu.Lock()
		attached := mc.rec.GetNetwork() == name
		mc.mu.Unlock()
		if attached {
			m.mu.Unlock()
			return apierr.Errorf(apierr.Conflict, "network %q has vm %s attached; delete the vm first", name, mc.id)
		}
	}
	delete(m.networks, name)
	m.mu.Unlock()
	if err := ns.run.Close(); err != nil {
		m.log.Warn("close network", "network", name, "error", err)
	}
	return m.store.DeleteNetwork(name)
}

// attach gives a VM an address on its network and persists the lease.
func (m *Manager) attach(netName, vmID string) (ip netip.Addr, mac string, err error) {
	m.mu.Lock()
	ns := m.networks[netName]
	m.mu.Unlock()
	if ns == nil {
		return netip.Addr{}, "", apierr.Invalidf("network", "network %q not found", netName)
	}
	ip, mac, err = ns.run.Allocate(vmID)
	if err != nil {
		return netip.Addr{}, "", err
	}
	return ip, mac, m.persistLeases(ns)
}

// detach releases a VM's lease.
func (m *Manager) detach(netName, vmID string) {
	m.mu.Lock()
	ns := m.networks[netName]
	m.mu.Unlock()
	if ns == nil {
		return
	}
	ns.run.Release(vmID)
	if err := m.persistLeases(ns); err != nil {
		m.log.Error("persist leases", "network", netName, "error", err)
	}
}

func (m *Manager) persistLeases(ns *netState) error {
	return m.store.PutNetwork(m.networkRecord(ns))
}

// ByIPIn finds the VM holding ip on one network; VMs being deleted are excluded.
func (m *Manager) ByIPIn(netName string, ip netip.Addr) (*hypervisorv1.VirtualMachine, bool) {
	ip = ip.Unmap()
	for _, rec := range m.records() {
		if rec.GetNetwork() != netName || rec.GetState() == hypervisorv1.State_STATE_DELETING {
			continue
		}
		if a, err := netip.ParseAddr(rec.GetIp()); err == nil && a == ip {
			return View(rec), true
		}
	}
	return nil, false
}
