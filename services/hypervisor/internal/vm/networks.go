package vm

import (
	"context"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
)

// The networks are the network package's Registry; the manager only says
// which VMs are on them (the IMDS's callers, a delete's check).

// CreateNetwork validates and starts a network, unless the host has
// MaxNetworks already.
func (m *Manager) CreateNetwork(_ context.Context, req *hypervisorv1.CreateNetworkRequest, createdBy string) (*hypervisorv1.Network, error) {
	m.netCreate.Lock()
	defer m.netCreate.Unlock()
	if n, max := len(m.nets.List()), m.cfg.Limits.MaxNetworks; n >= max {
		return nil, m.refuse(limitNetworks, "this host has %d networks, the maximum is %d (--max-networks): delete one first", n, max)
	}
	return m.nets.Create(req, createdBy)
}

// GetNetwork returns a network with its leases.
func (m *Manager) GetNetwork(name string) (*hypervisorv1.Network, error) { return m.nets.Get(name) }

// ListNetworks returns every network, sorted by name.
func (m *Manager) ListNetworks() []*hypervisorv1.Network { return m.nets.List() }

// DeleteNetwork stops a network no VM is attached to.
func (m *Manager) DeleteNetwork(_ context.Context, name string) error {
	return m.nets.Delete(name, m.attachedTo)
}

// attachedTo names a VM attached to the network, if any.
func (m *Manager) attachedTo(network string) (string, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, mc := range m.machines {
		mc.mu.Lock()
		attached := mc.rec.GetNetwork() == network
		mc.mu.Unlock()
		if attached {
			return mc.id, true
		}
	}
	return "", false
}
