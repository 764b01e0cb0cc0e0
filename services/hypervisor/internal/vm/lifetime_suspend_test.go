package vm

import (
	"context"
	"strings"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// lifetimeSuspendHarness is the suspend harness with a fast lifetime check.
func lifetimeSuspendHarness(t *testing.T) (*harness, *suspendDriver) {
	h, sd := suspendHarness(t)
	h.m.Close()
	h.tweak = func(c *Config) { c.Lifetimes.Tick = 20 * time.Millisecond }
	h.start()
	return h, sd
}

// on_idle: suspend suspends an idle VM instead of stopping it; a resume
// starts its idle clock again rather than suspending it at once.
func TestIdleSuspends(t *testing.T) {
	h, sd := lifetimeSuspendHarness(t)
	id := h.create("web").GetId()
	if err := h.m.Update(id, func(r *storepb.VirtualMachine) {
		r.Lifetime = &hypervisorv1.Lifetime{IdleTimeout: "400ms", OnIdle: hypervisorv1.OnIdle_ON_IDLE_SUSPEND, LastActivityAt: timestamppb.Now()}
	}); err != nil {
		t.Fatal(err)
	}
	// The reason is written just after the suspend itself: wait for both.
	v := h.waitFor(id, func(v *hypervisorv1.VirtualMachine) bool {
		return v.GetState() == hypervisorv1.State_STATE_SUSPENDED && v.GetLastError() != ""
	})
	if !strings.Contains(v.GetLastError(), "on_idle: suspend") || sd.Saved(&storepb.VirtualMachine{Id: id}) != nil {
		t.Fatalf("idle suspend: %q, saved: %v", v.GetLastError(), sd.Saved(&storepb.VirtualMachine{Id: id}))
	}
	waitActions(h, LifetimeIdleSuspend, 1)
	if n := h.m.LifetimeActions()[LifetimeIdleStop]; n != 0 {
		t.Errorf("idle_stop %d", n)
	}

	// Suspended longer than the timeout: the resume must not count it.
	waitPast(t, v.GetLifetime().GetLastActivityAt().AsTime().Add(600*time.Millisecond))
	if _, err := h.m.Resume(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	waitLifetimePasses(h, id, 2)
	if v, _ := h.m.Get(id); v.GetState() != hypervisorv1.State_STATE_READY || v.GetLifetime().GetLastActivity() != ActivityResume {
		t.Fatalf("after the resume: %v, %v", v.GetState(), v.GetLifetime())
	}
	// Idle again for the timeout: suspended again.
	h.waitFor(id, func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_SUSPENDED })
	waitActions(h, LifetimeIdleSuspend, 2)
}

// An expiry (on_expire: stop) that finds the VM suspended stops it as
// stop_vm does: the saved state is discarded and the expiry is cleared.
func TestExpiryStopsSuspended(t *testing.T) {
	h, sd := lifetimeSuspendHarness(t)
	id := h.create("web").GetId()
	if _, err := h.m.Suspend(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	if _, err := h.m.UpdateLifetime(context.Background(), &hypervisorv1.UpdateVirtualMachineLifetimeRequest{Id: id, Ttl: "1s"}); err != nil {
		t.Fatal(err)
	}
	v := h.waitFor(id, func(v *hypervisorv1.VirtualMachine) bool {
		return v.GetState() == hypervisorv1.State_STATE_STOPPED && v.GetLifetime() == nil
	})
	if !strings.Contains(v.GetLastError(), "lifetime expired") || !strings.Contains(v.GetLastError(), "saved state was discarded") {
		t.Errorf("lastError %q", v.GetLastError())
	}
	if sd.Saved(&storepb.VirtualMachine{Id: id}) == nil {
		t.Error("the saved state is still there")
	}
	waitActions(h, LifetimeExpiredStop, 1)
}
