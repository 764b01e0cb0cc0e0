package vm

import (
	"context"
	"fmt"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Bad lifetimes are refused with the field they are about; good ones are
// normalised (stop by default).
func TestCreateLifetime(t *testing.T) {
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	l := Lifetimes{MaxTTL: 24 * time.Hour}
	req := func(f func(*hypervisorv1.CreateVirtualMachineRequest)) *hypervisorv1.CreateVirtualMachineRequest {
		r := &hypervisorv1.CreateVirtualMachineRequest{Name: "x"}
		f(r)
		return r
	}
	for _, c := range []struct {
		name  string
		req   *hypervisorv1.CreateVirtualMachineRequest
		field string
	}{
		{"not a duration", req(func(r *hypervisorv1.CreateVirtualMachineRequest) { r.Ttl = "60" }), "ttl"},
		{"negative", req(func(r *hypervisorv1.CreateVirtualMachineRequest) { r.Ttl = "-5s" }), "ttl"},
		{"over the max", req(func(r *hypervisorv1.CreateVirtualMachineRequest) { r.Ttl = "25h" }), "ttl"},
		{"both", req(func(r *hypervisorv1.CreateVirtualMachineRequest) {
			r.Ttl, r.ExpireAt = "1h", timestamppb.New(now.Add(time.Hour))
		}), "ttl"},
		{"in the past", req(func(r *hypervisorv1.CreateVirtualMachineRequest) { r.ExpireAt = timestamppb.New(now.Add(-time.Hour)) }), "expire_at"},
		{"too far", req(func(r *hypervisorv1.CreateVirtualMachineRequest) {
			r.ExpireAt = timestamppb.New(now.Add(48 * time.Hour))
		}), "expire_at"},
		{"on_expire alone", req(func(r *hypervisorv1.CreateVirtualMachineRequest) { r.OnExpire = hypervisorv1.OnExpire_ON_EXPIRE_DELETE }), "on_expire"},
		{"unknown on_expire", req(func(r *hypervisorv1.CreateVirtualMachineRequest) { r.Ttl, r.OnExpire = "1h", 9 }), "on_expire"},
		{"idle too short", req(func(r *hypervisorv1.CreateVirtualMachineRequest) { r.IdleTimeout = "5s" }), "idle_timeout"},
		{"on_idle alone", req(func(r *hypervisorv1.CreateVirtualMachineRequest) { r.OnIdle = hypervisorv1.OnIdle_ON_IDLE_STOP }), "on_idle"},
	} {
		_, err := l.createLifetime(c.req, now)
		if apierr.CodeOf(err) != apierr.InvalidRequest || !strings.Contains(err.Error(), c.field) {
			t.Errorf("%s: %v, want invalid_request about %s", c.name, err, c.field)
		}
	}
	lt, err := l.createLifetime(req(func(r *hypervisorv1.CreateVirtualMachineRequest) { r.Ttl, r.IdleTimeout = "60s", "15m" }), now)
	want := &hypervisorv1.Lifetime{ExpireAt: timestamppb.New(now.Add(time.Minute)), OnExpire: hypervisorv1.OnExpire_ON_EXPIRE_STOP,
		IdleTimeout: "15m0s", OnIdle: hypervisorv1.OnIdle_ON_IDLE_STOP, LastActivityAt: timestamppb.New(now), LastActivity: ActivityLifetime}
	if err != nil || !proto.Equal(lt, want) {
		t.Errorf("ttl 60s, idle 15m: %v %v", lt, err)
	}
	if lt, err := l.createLifetime(req(func(*hypervisorv1.CreateVirtualMachineRequest) {}), now); lt != nil || err != nil {
		t.Errorf("no lifetime: %v %v", lt, err)
	}
	l.DefaultTTL = time.Hour
	if lt, err := l.createLifetime(req(func(*hypervisorv1.CreateVirtualMachineRequest) {}), now); err != nil || !lt.GetExpireAt().AsTime().Equal(now.Add(time.Hour)) {
		t.Errorf("--default-vm-ttl: %v %v", lt, err)
	}
}

func lifetimeHarness(t *testing.T) *harness {
	return newHarnessWith(t, func(c *Config) { c.Lifetimes.Tick = 20 * time.Millisecond })
}

// newHarnessWith is newHarness with the config changed by tweak.
func newHarnessWith(t *testing.T, tweak func(*Config)) *harness {
	h := newHarness(t)
	h.m.Close()
	h.tweak = tweak
	h.start()
	return h
}

func TestExpiryStops(t *testing.T) {
	h := lifetimeHarness(t)
	id := h.create("web").GetId()
	v, err := h.m.UpdateLifetime(context.Background(), &hypervisorv1.UpdateVirtualMachineLifetimeRequest{Id: id, Ttl: "1s"})
	if err != nil || v.GetLifetime().GetOnExpire() != hypervisorv1.OnExpire_ON_EXPIRE_STOP {
		t.Fatalf("update: %v %v", v, err)
	}
	v = h.waitFor(id, func(v *hypervisorv1.VirtualMachine) bool {
		return v.GetState() == hypervisorv1.State_STATE_STOPPED && v.GetLifetime() == nil
	})
	if !strings.Contains(v.GetLastError(), "lifetime expired") {
		t.Errorf("lastError %q", v.GetLastError())
	}
	waitActions(h, LifetimeExpiredStop, 1)
	// The expiry was carried out: a start runs unbounded.
	if _, err := h.m.Start(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	h.ready(id)
	waitLifetimePasses(h, id, 2)
	if v, _ := h.m.Get(id); v.GetState() != hypervisorv1.State_STATE_READY {
		t.Errorf("after a start: %v", v.GetState())
	}
}

func TestExpiryDeletes(t *testing.T) {
	h := lifetimeHarness(t)
	id := h.create("web").GetId()
	if _, err := h.m.UpdateLifetime(context.Background(), &hypervisorv1.UpdateVirtualMachineLifetimeRequest{Id: id, Ttl: "1s", OnExpire: hypervisorv1.OnExpire_ON_EXPIRE_DELETE}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for _, err := h.m.Get(id); apierr.CodeOf(err) != apierr.NotFound; _, err = h.m.Get(id) {
		if time.Now().After(deadline) {
			t.Fatal("not deleted")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Counted once the delete returns, which is after the record is gone.
	for h.m.LifetimeActions()[LifetimeExpiredDelete] != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("expired_delete %d", h.m.LifetimeActions()[LifetimeExpiredDelete])
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Extending pushes the expiry; clearing removes it; on_expire alone needs one.
func TestUpdateLifetime(t *testing.T) {
	h := lifetimeHarness(t)
	id := h.create("web").GetId()
	ctx := context.Background()
	if _, err := h.m.UpdateLifetime(ctx, &hypervisorv1.UpdateVirtualMachineLifetimeRequest{Id: id, OnExpire: hypervisorv1.OnExpire_ON_EXPIRE_DELETE}); apierr.CodeOf(err) != apierr.InvalidRequest {
		t.Errorf("on_expire without an expiry: %v", err)
	}
	if _, err := h.m.UpdateLifetime(ctx, &hypervisorv1.UpdateVirtualMachineLifetimeRequest{Id: id, IdleTimeout: proto.String("")}); apierr.CodeOf(err) != apierr.InvalidRequest {
		t.Errorf("empty idle_timeout: %v", err)
	}
	if _, err := h.m.UpdateLifetime(ctx, &hypervisorv1.UpdateVirtualMachineLifetimeRequest{Id: "ffffffff", Ttl: "1h"}); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("unknown vm: %v", err)
	}
	first := time.Now().Add(2 * time.Second)
	if _, err := h.m.UpdateLifetime(ctx, &hypervisorv1.UpdateVirtualMachineLifetimeRequest{Id: id, Ttl: "2s"}); err != nil {
		t.Fatal(err)
	}
	v, err := h.m.UpdateLifetime(ctx, &hypervisorv1.UpdateVirtualMachineLifetimeRequest{Id: id, Ttl: "1h", OnExpire: hypervisorv1.OnExpire_ON_EXPIRE_DELETE})
	if err != nil || time.Until(v.GetLifetime().GetExpireAt().AsTime()) < 59*time.Minute || v.GetLifetime().GetOnExpire() != hypervisorv1.OnExpire_ON_EXPIRE_DELETE {
		t.Fatalf("extend: %v %v", v.GetLifetime(), err)
	}
	waitPast(t, first) // past the first expiry, then checks that saw it
	waitLifetimePasses(h, id, 2)
	if v, _ := h.m.Get(id); v.GetState() != hypervisorv1.State_STATE_READY {
		t.Errorf("extended vm: %v", v.GetState())
	}
	if rec, _ := h.st.GetVM(id); time.Until(rec.GetLifetime().GetExpireAt().AsTime()) < 50*time.Minute {
		t.Errorf("stored lifetime: %v", rec.GetLifetime())
	}
	if v, err := h.m.UpdateLifetime(ctx, &hypervisorv1.UpdateVirtualMachineLifetimeRequest{Id: id, ClearExpiry: true}); err != nil || v.GetLifetime() != nil {
		t.Errorf("clear: %v %v", v.GetLifetime(), err)
	}
}

// idleFor gives a VM an idle timeout below the API's minimum, as a test may.
// waitActions waits for the count of a lifetime action: it is counted when
// the stop returns, which is just after the state a waiter sees.
func waitActions(h *harness, name string, want uint64) {
	h.t.Helper()
	poll.Until(h.t, fmt.Sprintf("%s counted %d times", name, want), func() bool { return h.m.LifetimeActions()[name] == want })
}

// waitLifetimePasses waits until the lifetime loop has checked every VM n
// more times, and until id has no action under way: a negative result ("not
// stopped") is then one the loop decided, not one it has yet to reach (an
// action it takes is under way from within the pass that decided it).
func waitLifetimePasses(h *harness, id string, n uint64) {
	h.t.Helper()
	want := h.m.lifetimePasses.Load() + n
	mc, err := h.m.get(id)
	if err != nil {
		h.t.Fatal(err)
	}
	poll.Until(h.t, "the lifetime loop's passes, with no action under way", func() bool {
		return h.m.lifetimePasses.Load() >= want && !mc.acting.Load()
	})
}

// waitPast waits for the wall clock to pass a lifetime's deadline.
func waitPast(t *testing.T, deadline time.Time) {
	t.Helper()
	poll.Until(t, "the clock to pass "+deadline.Format(time.RFC3339Nano), func() bool { return time.Now().After(deadline) })
}

func idleFor(h *harness, id string, d time.Duration) {
	if err := h.m.Update(id, func(r *storepb.VirtualMachine) {
		r.Lifetime = &hypervisorv1.Lifetime{IdleTimeout: d.String(), OnIdle: hypervisorv1.OnIdle_ON_IDLE_STOP, LastActivityAt: timestamppb.Now()}
	}); err != nil {
		h.t.Fatal(err)
	}
}

// An idle VM is stopped; a held one (an open exec session) is not, and
// activity restarts the clock.
func TestIdleStops(t *testing.T) {
	h := lifetimeHarness(t)
	id := h.create("web").GetId()
	release := h.m.Hold(id, ActivityExec)
	idle := time.Now().Add(300 * time.Millisecond)
	idleFor(h, id, 300*time.Millisecond)
	waitPast(t, idle) // idle for the timeout, then checks that saw it held
	waitLifetimePasses(h, id, 2)
	if v, _ := h.m.Get(id); v.GetState() != hypervisorv1.State_STATE_READY {
		t.Fatalf("held vm: %v", v.GetState())
	}
	release()
	if v, _ := h.m.Get(id); v.GetLifetime().GetLastActivity() != ActivityExec {
		t.Errorf("last activity %v", v.GetLifetime())
	}
	v := h.waitFor(id, func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_STOPPED })
	if !strings.Contains(v.GetLastError(), "idle_timeout") || v.GetLifetime().GetIdleTimeout() == "" {
		t.Errorf("idle stop: %q %v", v.GetLastError(), v.GetLifetime())
	}
	waitActions(h, LifetimeIdleStop, 1)
}

// An expiry that passed while the hypervisor was down is carried out at
// its start.
func TestExpiryAcrossRestart(t *testing.T) {
	h := lifetimeHarness(t)
	id := h.create("web").GetId()
	if _, err := h.m.UpdateLifetime(context.Background(), &hypervisorv1.UpdateVirtualMachineLifetimeRequest{Id: id, Ttl: "1h"}); err != nil {
		t.Fatal(err)
	}
	h.m.Close()
	rec, err := h.st.GetVM(id)
	if err != nil {
		t.Fatal(err)
	}
	rec.Lifetime.ExpireAt = timestamppb.New(time.Now().Add(-time.Minute)) // it passed meanwhile
	if err := h.st.PutVM(rec); err != nil {
		t.Fatal(err)
	}
	h.start()
	h.waitFor(id, func(v *hypervisorv1.VirtualMachine) bool {
		return v.GetState() == hypervisorv1.State_STATE_STOPPED && strings.Contains(v.GetLastError(), "lifetime expired")
	})
}

// A guest's IMDS requests are activity, except its report uploads, which
// vm-agent sends every 15 s by itself.
func TestIMDSActivity(t *testing.T) {
	m, mc := newTestManager(t, nil)
	mc.rec.Network = "n"
	m.leases[lease{"n", netip.MustParseAddr("10.0.0.2")}] = mc
	old := timestamppb.New(time.Now().Add(-time.Hour))
	mc.rec.Lifetime = &hypervisorv1.Lifetime{IdleTimeout: "1h0m0s", LastActivityAt: old}
	h := m.activeIMDS("n", http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	serve := func(method, path, from string) {
		r := httptest.NewRequest(method, path, nil)
		r.RemoteAddr = from
		h.ServeHTTP(httptest.NewRecorder(), r)
	}
	serve(http.MethodPost, imds.BasePath+"/report", "10.0.0.2:4000")
	serve(http.MethodGet, imds.BasePath+"/hostname", "10.0.0.9:4000") // another address
	if rec, _ := m.Record(mc.id); !proto.Equal(rec.GetLifetime().GetLastActivityAt(), old) {
		t.Fatalf("a report upload or a stranger's request counted: %v", rec.GetLifetime())
	}
	serve(http.MethodGet, imds.BasePath+"/metadata/k", "10.0.0.2:4000")
	if rec, _ := m.Record(mc.id); rec.GetLifetime().GetLastActivity() != ActivityIMDS || time.Since(rec.GetLifetime().GetLastActivityAt().AsTime()) > time.Minute {
		t.Errorf("a metadata read did not count: %v", rec.GetLifetime())
	}
}

// Bytes through a port forward, either way, are activity.
func TestForwardActivity(t *testing.T) {
	m, mc := newTestManager(t, nil)
	old := timestamppb.New(time.Now().Add(-time.Hour))
	mc.rec.Lifetime = &hypervisorv1.Lifetime{IdleTimeout: "1h0m0s", LastActivityAt: old}
	host, guest := net.Pipe()
	defer host.Close()
	c := m.activeConn(mc.id, guest)
	defer c.Close()
	go func() { _, _ = host.Read(make([]byte, 8)) }()
	if rec, _ := m.Record(mc.id); !proto.Equal(rec.GetLifetime().GetLastActivityAt(), old) {
		t.Fatal("a connection alone counted")
	}
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	if rec, _ := m.Record(mc.id); rec.GetLifetime().GetLastActivity() != ActivityForward {
		t.Errorf("bytes through a forward did not count: %v", rec.GetLifetime())
	}
}

// An expiry that finds the VM down is cleared without a stop; one that
// finds it still being created waits for it.
func TestExpiryOfADownVM(t *testing.T) {
	h := lifetimeHarness(t)
	id := h.create("web").GetId()
	if _, err := h.m.Stop(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	past := timestamppb.New(time.Now().Add(-time.Second))
	if err := h.m.Update(id, func(r *storepb.VirtualMachine) {
		r.Lifetime = &hypervisorv1.Lifetime{ExpireAt: past, OnExpire: hypervisorv1.OnExpire_ON_EXPIRE_STOP}
	}); err != nil {
		t.Fatal(err)
	}
	v := h.waitFor(id, func(v *hypervisorv1.VirtualMachine) bool { return v.GetLifetime() == nil })
	if v.GetState() != hypervisorv1.State_STATE_STOPPED || h.m.LifetimeActions()[LifetimeExpiredStop] != 0 {
		t.Errorf("%v, %d stops counted", v.GetState(), h.m.LifetimeActions()[LifetimeExpiredStop])
	}
	mc, _ := h.m.get(id)
	if due, _ := h.m.due(mc, time.Now()); due != actCount {
		t.Errorf("still due: %d", due)
	}
	// Creating: not consumed until it is up (then stopped). Set behind the
	// lifecycle's back, as a create still under way.
	mc.mu.Lock()
	mc.rec.State = hypervisorv1.State_STATE_CREATING
	mc.rec.Lifetime = &hypervisorv1.Lifetime{ExpireAt: past, OnExpire: hypervisorv1.OnExpire_ON_EXPIRE_STOP}
	mc.mu.Unlock()
	waitLifetimePasses(h, id, 3)
	if rec, _ := h.m.Record(id); rec.GetLifetime().GetExpireAt() == nil {
		t.Error("an expiry was cleared while the VM was being created")
	}
	mc.mu.Lock()
	mc.rec.State = hypervisorv1.State_STATE_STOPPED
	mc.mu.Unlock()
}
