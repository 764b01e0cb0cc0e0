package vm

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// The forks of a call wait for the parent's snapshot: each gets it, or
// its error; a fork whose call ends waits no longer.
func TestForkSource(t *testing.T) {
	ctx := context.Background()
	s := newForkSource()
	got := make(chan ForkSnapshot, 2)
	for range 2 {
		go func() { snap, _ := s.Wait(ctx); got <- snap }()
	}
	if _, err := s.snapshot(ctx, func(context.Context) (ForkSnapshot, error) {
		return ForkSnapshot{Pause: time.Millisecond, State: "state.bin"}, nil
	}); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if snap := <-got; snap.State != "state.bin" {
			t.Errorf("a fork got %+v", snap)
		}
	}

	s = newForkSource()
	failed := errors.New("no snapshot")
	if _, err := s.snapshot(ctx, func(context.Context) (ForkSnapshot, error) { return ForkSnapshot{}, failed }); err != failed {
		t.Errorf("snapshot: %v", err)
	}
	if _, err := s.Wait(ctx); err != failed {
		t.Errorf("Wait after a failed snapshot: %v", err)
	}

	s = newForkSource()
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.Wait(cctx); !errors.Is(err, context.Canceled) {
		t.Errorf("Wait with an ended context: %v", err)
	}
}

// The message a fork's vm-agent reads names its MAC, the parent, a fresh
// seed each time, and its address when it has one.
func TestForkMessage(t *testing.T) {
	rec := &storepb.VirtualMachine{Mac: "02:de:c0:a8:7f:03", Ip: "192.168.127.3", ForkedFrom: "0a0b0c0d"}
	a, b := string(forkMessage(rec)), string(forkMessage(rec))
	for _, want := range []string{"VMM_FORK=1\n", "VMM_FORK_MAC=02:de:c0:a8:7f:03\n", "VMM_FORK_PARENT=0a0b0c0d", "\nVMM_FORK_IP=192.168.127.3"} {
		if !strings.Contains(a, want) {
			t.Errorf("message lacks %q: %q", want, a)
		}
	}
	if a == b {
		t.Error("two messages with the same seed")
	}
	rec.Ip = ""
	if m := string(forkMessage(rec)); strings.Contains(m, "VMM_FORK_IP") {
		t.Errorf("a fork without a network is told an address: %q", m)
	}
}
