package kube

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/services/gateway/internal/fleet"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// running is a Discovery's Run on its own goroutine, its updates in a channel.
type running struct {
	updates chan []fleet.Member
	done    chan error
	cancel  context.CancelFunc
}

func start(t *testing.T, client *fake.Clientset) *running {
	t.Helper()
	cfg := testCfg
	cfg.Debounce = 20 * time.Millisecond
	d, err := New(client.DiscoveryV1().EndpointSlices(testNS), cfg, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	return runDiscovery(t, d)
}

func runDiscovery(t *testing.T, d *Discovery) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &running{updates: make(chan []fleet.Member, 16), done: make(chan error, 1), cancel: cancel}
	go func() { r.done <- d.Run(ctx, func(m []fleet.Member) { r.updates <- m }) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-r.done:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Errorf("Run did not return after its context ended")
		}
	})
	return r
}

// next waits for the next update (a deadline, not a timing assertion).
func (r *running) next(t *testing.T) []fleet.Member {
	t.Helper()
	select {
	case m := <-r.updates:
		return m
	case err := <-r.done:
		t.Fatalf("Run returned: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("no update within 10 s")
	}
	return nil
}

// waitWatch waits until the informer's watch is open: the fake clientset
// does not replay what happens between its list and its watch.
func waitWatch(t *testing.T, client *fake.Clientset) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		for _, a := range client.Actions() {
			if a.GetVerb() == "watch" && a.GetResource().Resource == "endpointslices" {
				return
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatal("the informer opened no watch on endpointslices")
}

func brief(ms []fleet.Member) string {
	var parts []string
	for _, m := range ms {
		parts = append(parts, fmt.Sprintf("%s=%d@%s/%v", m.Name, m.Index, m.Addr, m.Ready))
	}
	return strings.Join(parts, " ")
}

func expect(t *testing.T, r *running, want string) {
	t.Helper()
	if got := brief(r.next(t)); got != want {
		t.Fatalf("update %q, want %q", got, want)
	}
}

// The informer follows the Service's slices: the set already there is the
// first update; an added slice, a node becoming not ready, a changed
// address and a removed slice each produce the whole new set; another
// Service's slice produces none.
func TestDiscoveryFollowsSlices(t *testing.T) {
	ctx := context.Background()
	client := fake.NewClientset(slice("vmm-nodes-a", grpcPort, ep("vmm-node-0", "10.0.0.1", true)))
	slices := client.DiscoveryV1().EndpointSlices(testNS)
	r := start(t, client)
	expect(t, r, "vmm-node-0=0@10.0.0.1:8443/true")
	waitWatch(t, client)

	// A second slice of the same Service.
	b := slice("vmm-nodes-b", grpcPort, ep("vmm-node-1", "10.0.0.2", true), ep("vmm-node-2", "10.0.0.3", true))
	if _, err := slices.Create(ctx, b, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	expect(t, r, "vmm-node-0=0@10.0.0.1:8443/true vmm-node-1=1@10.0.0.2:8443/true vmm-node-2=2@10.0.0.3:8443/true")

	// Node 1 stops being ready; node 2's pod comes back with another address.
	b.Endpoints[0].Conditions.Ready = ptr(false)
	b.Endpoints[1].Addresses = []string{"10.0.0.33"}
	if _, err := slices.Update(ctx, b, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	expect(t, r, "vmm-node-0=0@10.0.0.1:8443/true vmm-node-1=1@10.0.0.2:8443/false vmm-node-2=2@10.0.0.33:8443/true")

	// Another Service's slice changes nothing: the next update is the
	// removal below, not a repeat.
	other := slice("other-a", grpcPort, ep("other-7", "10.0.0.7", true))
	other.Labels[discoveryv1.LabelServiceName] = "other"
	if _, err := slices.Create(ctx, other, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := slices.Delete(ctx, "vmm-nodes-a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	expect(t, r, "vmm-node-1=1@10.0.0.2:8443/false vmm-node-2=2@10.0.0.33:8443/true")

	if err := slices.Delete(ctx, "vmm-nodes-b", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	expect(t, r, "")
	select {
	case m := <-r.updates:
		t.Fatalf("an extra update %q", brief(m))
	default:
	}
}

// An empty Service is reported as an empty set at once (the router then
// knows it has no nodes rather than waiting), and a slice whose endpoints
// all lack the port adds nobody.
func TestDiscoveryEmptyAndSkipped(t *testing.T) {
	client := fake.NewClientset()
	r := start(t, client)
	expect(t, r, "")
	waitWatch(t, client)
	ctx := context.Background()
	slices := client.DiscoveryV1().EndpointSlices(testNS)
	if _, err := slices.Create(ctx, slice("vmm-nodes-a", map[string]int32{"http": 8080}, ep("vmm-node-0", "10.0.0.1", true)), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := slices.Create(ctx, slice("vmm-nodes-b", grpcPort, ep("vmm-node-1", "10.0.0.2", true)), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Debounced, the two creations may come as one update or two; the
	// last holds node 1 only.
	for {
		got := brief(r.next(t))
		if got == "vmm-node-1=1@10.0.0.2:8443/true" {
			break
		}
		if got != "" {
			t.Fatalf("update %q", got)
		}
	}
}

func TestNewNeedsServiceAndNamespace(t *testing.T) {
	_, err := New(fake.NewClientset().DiscoveryV1().EndpointSlices(testNS), Config{PortName: "grpc"}, slog.New(slog.DiscardHandler))
	if err == nil || !strings.Contains(err.Error(), "--fleet-namespace") || !strings.Contains(err.Error(), "--fleet-service") {
		t.Fatalf("New without namespace and service: %v", err)
	}
}
