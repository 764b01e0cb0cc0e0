package network

import (
	"context"
	"errors"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"io"
	"log/slog"
	"net/http"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

func testLogger(t *testing.T) *slog.Logger {
	if testing.Verbose() {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.NewTextHandler(io.Discard, nil))
}

func startTest(t *testing.T, spec Spec, leases map[string]netip.Addr, imds http.Handler) *Network {
	t.Helper()
	n, err := Start(t.Context(), spec, leases, imds, Limits{}, testLogger(t))
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() { _ = n.Close() })
	return n
}

func mustAllocate(t *testing.T, n *Network, vm string) netip.Addr {
	t.Helper()
	ip, mac, err := n.Allocate(vm)
	if err != nil {
		t.Fatalf("Allocate(%s): %v", vm, err)
	}
	if mac != MAC(n.Name(), ip) {
		t.Fatalf("Allocate(%s) MAC %s, want %s", vm, mac, MAC(n.Name(), ip))
	}
	return ip
}

func TestAllocate(t *testing.T) {
	n := startTest(t, Spec{Name: "small", CIDR: "10.9.0.0/29"}, nil, nil)
	a := mustAllocate(t, n, "a")
	b := mustAllocate(t, n, "b")
	if a.String() != "10.9.0.2" || b.String() != "10.9.0.3" {
		t.Fatalf("got %s %s, want lowest free 10.9.0.2 10.9.0.3", a, b)
	}
	if again := mustAllocate(t, n, "a"); again != a {
		t.Fatalf("second Allocate(a) = %s, want %s", again, a)
	}
	c := mustAllocate(t, n, "c")
	d := mustAllocate(t, n, "d")
	if c.String() != "10.9.0.4" || d.String() != "10.9.0.5" {
		t.Fatalf("got %s %s", c, d)
	}
	_, _, err := n.Allocate("e")
	if !errors.Is(err, apierr.ErrConflict) {
		t.Fatalf("Allocate on full pool: %v, want conflict", err)
	}
	n.Release("b")
	n.Release("nope") // no-op
	if e := mustAllocate(t, n, "e"); e != b {
		t.Fatalf("after release got %s, want reused %s", e, b)
	}
	want := map[string]string{"a": "10.9.0.2", "e": "10.9.0.3", "c": "10.9.0.4", "d": "10.9.0.5"}
	got := n.Leases()
	if len(got) != len(want) {
		t.Fatalf("Leases = %v", got)
	}
	for k, v := range want {
		if got[k].String() != v {
			t.Fatalf("Leases = %v, want %v", got, want)
		}
	}
	// The copy is detached.
	delete(got, "a")
	if _, ok := n.Leases()["a"]; !ok {
		t.Fatal("Leases returned the internal map")
	}
	if _, _, err := n.Allocate(""); !errors.Is(err, apierr.ErrInvalid) {
		t.Fatalf("Allocate(\"\"): %v", err)
	}
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	if err := n.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, _, err := n.Allocate("z"); !errors.Is(err, apierr.ErrConflict) {
		t.Fatalf("Allocate after Close: %v, want conflict", err)
	}
}

func TestRestoredLeases(t *testing.T) {
	leases := map[string]netip.Addr{
		"kept":    netip.MustParseAddr("10.8.0.3"),
		"a-dup":   netip.MustParseAddr("10.8.0.5"),
		"b-dup":   netip.MustParseAddr("10.8.0.5"),        // held twice: dropped (a-dup wins)
		"gateway": netip.MustParseAddr("10.8.0.1"),        // not in pool
		"alias":   netip.MustParseAddr("10.8.0.254"),      // not in pool
		"outside": netip.MustParseAddr("10.9.0.3"),        // not in prefix
		"mapped":  netip.MustParseAddr("::ffff:10.8.0.9"), // IPv4-mapped: unmapped and kept
	}
	n := startTest(t, Spec{Name: "restore", CIDR: "10.8.0.0/24"}, leases, nil)
	got := n.Leases()
	want := map[string]string{"kept": "10.8.0.3", "a-dup": "10.8.0.5", "mapped": "10.8.0.9"}
	if len(got) != len(want) {
		t.Fatalf("Leases = %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k].String() != v {
			t.Fatalf("Leases = %v, want %v", got, want)
		}
	}
	if ip := mustAllocate(t, n, "kept"); ip.String() != "10.8.0.3" {
		t.Fatalf("restored VM got %s", ip)
	}
	if ip := mustAllocate(t, n, "new1"); ip.String() != "10.8.0.2" {
		t.Fatalf("new1 got %s", ip)
	}
	if ip := mustAllocate(t, n, "new2"); ip.String() != "10.8.0.4" {
		t.Fatalf("new2 got %s", ip)
	}
	if ip := mustAllocate(t, n, "new3"); ip.String() != "10.8.0.6" {
		t.Fatalf("new3 got %s", ip)
	}
}

func TestStartRejects(t *testing.T) {
	ctx := t.Context()
	if _, err := Start(ctx, Spec{Name: "Bad", CIDR: "10.0.0.0/24"}, nil, nil, Limits{}, nil); !errors.Is(err, apierr.ErrInvalid) {
		t.Fatalf("bad name: %v", err)
	}
	if _, err := Start(ctx, Spec{Name: "ok", CIDR: "10.0.0.0/8"}, nil, nil, Limits{}, nil); !errors.Is(err, apierr.ErrInvalid) {
		t.Fatalf("bad CIDR: %v", err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := Start(cancelled, Spec{Name: "ok", CIDR: "10.0.0.0/24"}, nil, nil, Limits{}, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled context: %v", err)
	}
}

func bytesOf(c byte, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = c
	}
	return b
}

func TestContextCancelCloses(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	n, err := Start(ctx, Spec{Name: "ctx", CIDR: "10.7.0.0/24"}, nil, nil, Limits{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	poll.Until(t, "network closed", func() bool {
		n.mu.Lock()
		defer n.mu.Unlock()
		return n.closed
	})
	n.wg.Wait()
	if _, _, err := n.Allocate("x"); !errors.Is(err, apierr.ErrConflict) {
		t.Fatalf("Allocate after cancel: %v", err)
	}
}

func TestLargeNetwork(t *testing.T) {
	start := time.Now()
	n := startTest(t, Spec{Name: "big", CIDR: "10.200.0.0/16"}, map[string]netip.Addr{"last": netip.MustParseAddr("10.200.255.253")}, nil)
	t.Logf("Start of a /16 took %v", time.Since(start))
	if ip := mustAllocate(t, n, "first"); ip.String() != "10.200.0.2" {
		t.Fatalf("got %s", ip)
	}
	if len(n.Leases()) != 2 {
		t.Fatalf("leases %v", n.Leases())
	}
}
