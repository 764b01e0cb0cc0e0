// Package fleet is the gateway's fleet mode: one API in front of many KVM
// nodes, each a hypervisor + attestation + gateway triple. This file is the
// seam between discovery (a static list, or Kubernetes EndpointSlices in
// package kube) and the router: discovery reports Members, the router dials
// and routes to them.
package fleet

import (
	"context"
	"fmt"
	"strconv"
	"strings"
)

// MaxIndex is the largest node index: a VM id's first three hex characters
// are its node's index (hypervisor --node-index), so a call for a VM goes
// straight to its node with no fleet-wide lookup.
const MaxIndex = 0xfff

// Member is one node of the fleet as discovery sees it.
type Member struct {
	// Name is the node's stable name: the pod's name in a StatefulSet
	// (vmm-node-2), or the static list's name.
	Name string
	// Index is the node's index, the prefix of its VM ids (the StatefulSet
	// ordinal); 0..MaxIndex.
	Index int
	// Addr is host:port of the node gateway's gRPC API.
	Addr string
	// ServerName, if set, is the name the node's TLS certificate is checked
	// against (Addr's host otherwise): a pod IP is dialled, the pod's DNS
	// name under the headless Service is verified.
	ServerName string
	// NodeName and Zone are where Kubernetes placed it (informational, and
	// the zone joins the node's labels for placement).
	NodeName string
	Zone     string
	// Ready is false for a node discovery knows but that is not ready: its
	// VMs answer unavailable rather than not_found.
	Ready bool
}

// Discovery reports the fleet's members: Run calls update with the whole set
// each time it changes (first as soon as it is known), until ctx ends.
type Discovery interface {
	Run(ctx context.Context, update func([]Member)) error
}

// Static is a fixed list of members (--fleet-nodes): tests, and hosts
// outside Kubernetes.
type Static []Member

// Run reports the list once and waits for ctx.
func (s Static) Run(ctx context.Context, update func([]Member)) error {
	update(append([]Member(nil), s...))
	<-ctx.Done()
	return nil
}

// ParseStatic reads "name=index@host:port[,...]", e.g.
// "node-0=0@10.0.0.1:8443,node-1=1@10.0.0.2:8443". Names and indexes must be
// unique.
func ParseStatic(s string) (Static, error) {
	var out Static
	names, indexes := map[string]bool{}, map[int]bool{}
	for _, item := range strings.Split(s, ",") {
		item = strings.TrimSpace(item)
		if item == "" {
			continue
		}
		name, rest, ok1 := strings.Cut(item, "=")
		idx, addr, ok2 := strings.Cut(rest, "@")
		if !ok1 || !ok2 || name == "" || addr == "" {
			return nil, fmt.Errorf("fleet node %q: want name=index@host:port", item)
		}
		i, err := strconv.Atoi(idx)
		if err != nil || i < 0 || i > MaxIndex {
			return nil, fmt.Errorf("fleet node %q: index must be 0..%d", item, MaxIndex)
		}
		if names[name] || indexes[i] {
			return nil, fmt.Errorf("fleet node %q: name or index used twice", item)
		}
		names[name], indexes[i] = true, true
		out = append(out, Member{Name: name, Index: i, Addr: addr, Ready: true})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("fleet nodes: empty list")
	}
	return out, nil
}

// IndexOf is the node index a VM id names, and false for an id that names
// none (not 8 hex characters).
func IndexOf(vmID string) (int, bool) {
	if len(vmID) != 8 {
		return 0, false
	}
	n, err := strconv.ParseUint(vmID[:3], 16, 16)
	if err != nil {
		return 0, false
	}
	if _, err := strconv.ParseUint(vmID[3:], 16, 32); err != nil {
		return 0, false
	}
	return int(n), true
}
