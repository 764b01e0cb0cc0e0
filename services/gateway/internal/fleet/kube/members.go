// Package kube discovers the fleet's nodes through the Kubernetes API: the
// EndpointSlices of the node pods' headless Service, one endpoint per node
// pod of the StatefulSet, followed with an informer.
package kube

import (
	"cmp"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"

	"github.com/giantswarm/vm-manager/services/gateway/internal/fleet"
	discoveryv1 "k8s.io/api/discovery/v1"
)

// Skip is an endpoint that names no usable member, and why: logged, so an
// operator sees why a pod of the Service is not in the fleet.
type Skip struct {
	Slice    string // the EndpointSlice's name
	Endpoint string // the endpoint's pod name, hostname or first address
	Reason   string
}

func (s Skip) String() string { return fmt.Sprintf("%s/%s: %s", s.Slice, s.Endpoint, s.Reason) }

// Members turns the Service's EndpointSlices into the fleet's members, sorted
// by index: each endpoint with a pod name (or hostname) ending in its
// StatefulSet ordinal, an address and the port named cfg.PortName is one
// member. An endpoint found in several slices (a pod's IPv4 and IPv6
// slices, or a slice being split) is one member, ready if any of its entries
// is. Slices of another Service or namespace are ignored (a fake or a
// misconfigured selector must not add nodes).
func Members(slicesIn []*discoveryv1.EndpointSlice, cfg Config) ([]fleet.Member, []Skip) {
	sorted := slices.Clone(slicesIn)
	slices.SortFunc(sorted, func(a, b *discoveryv1.EndpointSlice) int { return cmp.Compare(a.Name, b.Name) })
	byName := map[string]*fleet.Member{}
	var skips []Skip
	for _, s := range sorted {
		if s.Labels[discoveryv1.LabelServiceName] != cfg.Service || (cfg.Namespace != "" && s.Namespace != cfg.Namespace) {
			continue
		}
		port, ok := findPort(s, cfg.PortName)
		for _, ep := range s.Endpoints {
			id := endpointID(ep)
			if !ok {
				skips = append(skips, Skip{s.Name, id, fmt.Sprintf("the slice has no port named %q", cfg.PortName)})
				continue
			}
			m, reason := member(ep, port, cfg)
			if reason != "" {
				skips = append(skips, Skip{s.Name, id, reason})
				continue
			}
			if prev, dup := byName[m.Name]; dup {
				// The same pod twice: keep the first ready entry.
				if !prev.Ready && m.Ready {
					*prev = m
				}
				continue
			}
			byName[m.Name] = &m
		}
	}
	out := make([]fleet.Member, 0, len(byName))
	for _, m := range byName {
		out = append(out, *m)
	}
	slices.SortFunc(out, func(a, b fleet.Member) int { return cmp.Or(cmp.Compare(a.Index, b.Index), cmp.Compare(a.Name, b.Name)) })
	// Two pods with one ordinal (two StatefulSets behind one Service): VM
	// ids could not tell them apart, so only the first by name is a member.
	kept := out[:0]
	for i, m := range out {
		if i > 0 && out[i-1].Index == m.Index {
			skips = append(skips, Skip{"", m.Name, fmt.Sprintf("index %d is %s's already", m.Index, kept[len(kept)-1].Name)})
			continue
		}
		kept = append(kept, m)
	}
	return kept, skips
}

func findPort(s *discoveryv1.EndpointSlice, name string) (int32, bool) {
	for _, p := range s.Ports {
		if p.Name != nil && *p.Name == name && p.Port != nil {
			return *p.Port, true
		}
	}
	return 0, false
}

func endpointID(ep discoveryv1.Endpoint) string {
	switch {
	case ep.TargetRef != nil && ep.TargetRef.Name != "":
		return ep.TargetRef.Name
	case ep.Hostname != nil && *ep.Hostname != "":
		return *ep.Hostname
	case len(ep.Addresses) > 0:
		return ep.Addresses[0]
	}
	return "?"
}

// member is one endpoint as a Member, or the reason it is none.
func member(ep discoveryv1.Endpoint, port int32, cfg Config) (fleet.Member, string) {
	name := ""
	if ep.TargetRef != nil && ep.TargetRef.Kind == "Pod" {
		name = ep.TargetRef.Name
	} else if ep.Hostname != nil {
		name = *ep.Hostname
	}
	if name == "" {
		return fleet.Member{}, "no pod (targetRef) and no hostname"
	}
	index, ok := Ordinal(name)
	if !ok {
		return fleet.Member{}, fmt.Sprintf("name %q does not end in a StatefulSet ordinal 0..%d", name, fleet.MaxIndex)
	}
	if len(ep.Addresses) == 0 || ep.Addresses[0] == "" {
		return fleet.Member{}, "no address"
	}
	m := fleet.Member{
		Name:  name,
		Index: index,
		Addr:  net.JoinHostPort(ep.Addresses[0], strconv.Itoa(int(port))),
		// The API: a nil ready is unknown, to be taken as ready.
		Ready: ep.Conditions.Ready == nil || *ep.Conditions.Ready,
	}
	if cfg.ServerNameSuffix != "" {
		// A StatefulSet pod's DNS name under its headless Service is
		// <hostname>.<service>.<namespace>.svc: the name its certificate holds.
		host := name
		if ep.Hostname != nil && *ep.Hostname != "" {
			host = *ep.Hostname
		}
		m.ServerName = host + "." + strings.TrimPrefix(cfg.ServerNameSuffix, ".")
	}
	if ep.NodeName != nil {
		m.NodeName = *ep.NodeName
	}
	if ep.Zone != nil {
		m.Zone = *ep.Zone
	}
	return m, ""
}

// Ordinal is the StatefulSet ordinal a pod name ends in (vmm-node-12: 12).
// The pod-index label is not on endpoints, so the name is what tells it.
func Ordinal(pod string) (int, bool) {
	i := strings.LastIndexByte(pod, '-')
	if i < 0 {
		return 0, false
	}
	s := pod[i+1:]
	// Digits only, no sign or leading zero: a name is the ordinal's one spelling.
	if s == "" || (len(s) > 1 && s[0] == '0') || strings.TrimLeft(s, "0123456789") != "" {
		return 0, false
	}
	n, err := strconv.Atoi(s)
	if err != nil || n > fleet.MaxIndex {
		return 0, false
	}
	return n, true
}
