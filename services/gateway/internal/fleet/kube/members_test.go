package kube

import (
	"fmt"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/services/gateway/internal/fleet"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

const (
	testNS  = "vmm"
	testSvc = "vmm-nodes"
)

var testCfg = Config{Namespace: testNS, Service: testSvc, PortName: "grpc"}

func ptr[T any](v T) *T { return &v }

// ep is a StatefulSet pod's endpoint as the EndpointSlice controller writes
// it: the pod as targetRef, its hostname, node and zone.
func ep(pod, addr string, ready bool) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{
		Addresses:  []string{addr},
		Conditions: discoveryv1.EndpointConditions{Ready: ptr(ready)},
		Hostname:   ptr(pod),
		TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: testNS, Name: pod},
		NodeName:   ptr("kvm-" + pod[strings.LastIndexByte(pod, '-')+1:]),
		Zone:       ptr("zone-a"),
	}
}

func slice(name string, ports map[string]int32, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	s := &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: testNS, Labels: map[string]string{discoveryv1.LabelServiceName: testSvc}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   eps,
	}
	for n, p := range ports {
		s.Ports = append(s.Ports, discoveryv1.EndpointPort{Name: ptr(n), Port: ptr(p), Protocol: ptr(corev1.ProtocolTCP)})
	}
	return s
}

var grpcPort = map[string]int32{"grpc": 8443, "http": 8080}

func TestMembers(t *testing.T) {
	member := func(i int, addr string, ready bool) fleet.Member {
		return fleet.Member{Name: fmt.Sprintf("vmm-node-%d", i), Index: i, Addr: addr, NodeName: fmt.Sprintf("kvm-%d", i), Zone: "zone-a", Ready: ready}
	}
	for _, tc := range []struct {
		name   string
		cfg    Config
		slices []*discoveryv1.EndpointSlice
		want   []fleet.Member
		skips  []string // substrings, one per skip, in order
	}{{
		name:   "one slice, sorted by index, the grpc port",
		slices: []*discoveryv1.EndpointSlice{slice("a", grpcPort, ep("vmm-node-2", "10.0.0.2", true), ep("vmm-node-0", "10.0.0.1", true))},
		want:   []fleet.Member{member(0, "10.0.0.1:8443", true), member(2, "10.0.0.2:8443", true)},
	}, {
		name: "not ready stays a member, nil ready is ready",
		slices: []*discoveryv1.EndpointSlice{slice("a", grpcPort, ep("vmm-node-0", "10.0.0.1", false), func() discoveryv1.Endpoint {
			e := ep("vmm-node-1", "10.0.0.2", true)
			e.Conditions.Ready = nil
			return e
		}())},
		want: []fleet.Member{member(0, "10.0.0.1:8443", false), member(1, "10.0.0.2:8443", true)},
	}, {
		name: "two slices of one service merge",
		slices: []*discoveryv1.EndpointSlice{
			slice("b", grpcPort, ep("vmm-node-1", "10.0.0.2", true)),
			slice("a", grpcPort, ep("vmm-node-0", "10.0.0.1", true)),
		},
		want: []fleet.Member{member(0, "10.0.0.1:8443", true), member(1, "10.0.0.2:8443", true)},
	}, {
		name: "a pod in two slices is one member, the ready entry wins",
		slices: []*discoveryv1.EndpointSlice{
			slice("a", grpcPort, ep("vmm-node-0", "10.0.0.1", false)),
			slice("b", grpcPort, ep("vmm-node-0", "10.0.0.9", true)),
		},
		want: []fleet.Member{member(0, "10.0.0.9:8443", true)},
	}, {
		name: "another service's and another namespace's slices are ignored",
		slices: []*discoveryv1.EndpointSlice{
			func() *discoveryv1.EndpointSlice {
				s := slice("x", grpcPort, ep("other-3", "10.0.0.3", true))
				s.Labels[discoveryv1.LabelServiceName] = "other"
				return s
			}(),
			func() *discoveryv1.EndpointSlice {
				s := slice("y", grpcPort, ep("vmm-node-4", "10.0.0.4", true))
				s.Namespace = "elsewhere"
				return s
			}(),
			slice("a", grpcPort, ep("vmm-node-0", "10.0.0.1", true)),
		},
		want: []fleet.Member{member(0, "10.0.0.1:8443", true)},
	}, {
		name: "endpoints that name no member are skipped with a reason",
		slices: []*discoveryv1.EndpointSlice{
			slice("a", map[string]int32{"http": 8080}, ep("vmm-node-5", "10.0.0.5", true)),
			slice("b", grpcPort,
				discoveryv1.Endpoint{Addresses: []string{"10.0.0.6"}},
				ep("vmm-node-x", "10.0.0.7", true),
				ep("vmm-node-4096", "10.0.0.8", true),
				ep("vmm-node-01", "10.0.0.9", true),
				func() discoveryv1.Endpoint { e := ep("vmm-node-3", "", true); e.Addresses = nil; return e }(),
				ep("vmm-node-1", "10.0.0.2", true),
			),
		},
		want: []fleet.Member{member(1, "10.0.0.2:8443", true)},
		skips: []string{
			`a/vmm-node-5: the slice has no port named "grpc"`,
			"b/10.0.0.6: no pod (targetRef) and no hostname",
			`b/vmm-node-x: name "vmm-node-x" does not end in a StatefulSet ordinal`,
			`b/vmm-node-4096: name "vmm-node-4096" does not end`,
			`b/vmm-node-01: name "vmm-node-01" does not end`,
			"b/vmm-node-3: no address",
		},
	}, {
		name: "a hostname without a targetRef names the member",
		slices: []*discoveryv1.EndpointSlice{slice("a", grpcPort, func() discoveryv1.Endpoint {
			e := ep("vmm-node-0", "10.0.0.1", true)
			e.TargetRef = nil
			return e
		}())},
		want: []fleet.Member{member(0, "10.0.0.1:8443", true)},
	}, {
		name:   "two pods with one ordinal: the first by name",
		slices: []*discoveryv1.EndpointSlice{slice("a", grpcPort, ep("vmm-zeta-1", "10.0.0.3", true), ep("vmm-alpha-1", "10.0.0.2", true))},
		want:   []fleet.Member{{Name: "vmm-alpha-1", Index: 1, Addr: "10.0.0.2:8443", NodeName: "kvm-1", Zone: "zone-a", Ready: true}},
		skips:  []string{"vmm-zeta-1: index 1 is vmm-alpha-1's already"},
	}, {
		name:   "server names under the headless Service, IPv6 addresses bracketed",
		cfg:    Config{Namespace: testNS, Service: testSvc, PortName: "grpc", ServerNameSuffix: "vmm-nodes.vmm.svc"},
		slices: []*discoveryv1.EndpointSlice{slice("a", grpcPort, ep("vmm-node-0", "fd00::1", true))},
		want:   []fleet.Member{{Name: "vmm-node-0", Index: 0, Addr: "[fd00::1]:8443", ServerName: "vmm-node-0.vmm-nodes.vmm.svc", NodeName: "kvm-0", Zone: "zone-a", Ready: true}},
	}, {
		name:   "another port name",
		cfg:    Config{Namespace: testNS, Service: testSvc, PortName: "http"},
		slices: []*discoveryv1.EndpointSlice{slice("a", grpcPort, ep("vmm-node-0", "10.0.0.1", true))},
		want:   []fleet.Member{member(0, "10.0.0.1:8080", true)},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			if cfg.Service == "" {
				cfg = testCfg
			}
			got, skips := Members(tc.slices, cfg)
			if fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("members\n got %+v\nwant %+v", got, tc.want)
			}
			if len(skips) != len(tc.skips) {
				t.Fatalf("skips %q, want %d: %q", skips, len(tc.skips), tc.skips)
			}
			for i, s := range skips {
				if !strings.Contains(s.String(), tc.skips[i]) {
					t.Errorf("skip %d: %q, want it to contain %q", i, s, tc.skips[i])
				}
			}
		})
	}
}

func TestOrdinal(t *testing.T) {
	for name, want := range map[string]int{"vmm-node-0": 0, "a-b-12": 12, "x-4095": 4095, "x-4096": -1, "x-01": -1, "x-": -1, "x": -1, "x-+1": -1, "x-1a": -1} {
		got, ok := Ordinal(name)
		if !ok {
			got = -1
		}
		if got != want {
			t.Errorf("Ordinal(%q) = %d, %v; want %d", name, got, ok, want)
		}
	}
}
