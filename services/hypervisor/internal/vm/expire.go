package vm

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// What lifetimes did, as counted (TelemetryService lifetime_actions_total).
const (
	LifetimeExpiredStop   = "expired_stop"
	LifetimeExpiredDelete = "expired_delete"
	LifetimeIdleStop      = "idle_stop"
	LifetimeIdleSuspend   = "idle_suspend"
)

const (
	actExpiredStop = iota
	actExpiredDelete
	actIdleStop
	actIdleSuspend
	actCount
)

var lifetimeActionNames = [actCount]string{LifetimeExpiredStop, LifetimeExpiredDelete, LifetimeIdleStop, LifetimeIdleSuspend}

type lifetimeActions [actCount]atomic.Uint64

// LifetimeActions counts what lifetimes did since the hypervisor started.
func (ac *Activity) LifetimeActions() map[string]uint64 {
	out := make(map[string]uint64, actCount)
	for i, n := range lifetimeActionNames {
		out[n] = ac.lifetimeActs[i].Load()
	}
	return out
}

// lifetimeLoop carries out expiries and idle timeouts. The records are the
// timers: the first check runs at once, so an expiry that passed while the
// hypervisor was down is acted on at its start.
func (m *Manager) lifetimeLoop() {
	t := time.NewTicker(m.cfg.Lifetimes.Tick)
	defer t.Stop()
	for {
		m.checkLifetimes(time.Now())
		select {
		case <-m.ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (m *Manager) checkLifetimes(now time.Time) {
	m.table.mu.Lock()
	if m.table.closing {
		m.table.mu.Unlock()
		return
	}
	defer m.activity.lifetimePasses.Add(1)
	mcs := make([]*machine, 0, len(m.table.machines))
	for _, mc := range m.table.machines {
		mcs = append(mcs, mc)
	}
	m.table.mu.Unlock()
	for _, mc := range mcs {
		if mc.acting.Load() {
			continue
		}
		switch act, why := m.activity.due(mc, now); act {
		case actExpiredStop, actExpiredDelete, actIdleStop, actIdleSuspend:
			if mc.acting.CompareAndSwap(false, true) {
				m.wg.Go(func() {
					defer mc.acting.Store(false)
					m.carryOut(mc, act, why)
				})
			}
		default:
			m.activity.persistActivity(mc)
		}
	}
}

// due says what mc's lifetime asks for at now (actCount: nothing), and why
// (its lastError).
func (ac *Activity) due(mc *machine, now time.Time) (int, string) {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	lt, state := mc.rec.GetLifetime(), mc.rec.GetState()
	if lt == nil || state == hypervisorv1.State_STATE_DELETING {
		return actCount, ""
	}
	if at := lt.GetExpireAt(); at != nil && !now.Before(at.AsTime()) {
		why := fmt.Sprintf("its lifetime expired at %s (on_expire: ", at.AsTime().UTC().Format(time.RFC3339))
		if lt.GetOnExpire() == hypervisorv1.OnExpire_ON_EXPIRE_DELETE {
			return actExpiredDelete, why + "delete)"
		}
		return actExpiredStop, "stopped: " + why + "stop)"
	}
	idle, err := time.ParseDuration(lt.GetIdleTimeout())
	if err != nil || idle <= 0 || mc.holds.Load() > 0 || mc.run == nil {
		return actCount, ""
	}
	// Only an up guest is idle: a boot longer than the timeout is not.
	if state != hypervisorv1.State_STATE_READY && state != hypervisorv1.State_STATE_RUNNING {
		return actCount, ""
	}
	if now.Sub(ac.idleSince(mc.rec)) < idle {
		return actCount, ""
	}
	if lt.GetOnIdle() == hypervisorv1.OnIdle_ON_IDLE_SUSPEND {
		return actIdleSuspend, fmt.Sprintf("suspended: no exec, forward or IMDS traffic for %s (idle_timeout; on_idle: suspend)", idle)
	}
	return actIdleStop, fmt.Sprintf("stopped: no exec, forward or IMDS traffic for %s (idle_timeout; on_idle: stop)", idle)
}

// idleSince is when a record's idle clock started: its last activity, its
// readiness, or this hypervisor's start, the latest of them.
func (ac *Activity) idleSince(rec *storepb.VirtualMachine) time.Time {
	since := ac.started
	for _, ts := range []interface{ AsTime() time.Time }{rec.GetLifetime().GetLastActivityAt(), rec.GetReadyAt()} {
		if t := ts.AsTime(); t.After(since) {
			since = t
		}
	}
	return since
}

// carryOut stops or deletes mc for its lifetime, once more checking under
// the operation lock that it is still due (an update may have extended it).
func (m *Manager) carryOut(mc *machine, act int, why string) {
	if act == actIdleSuspend {
		m.idleSuspend(mc, why)
		return
	}
	if act == actExpiredDelete {
		if again, _ := m.activity.due(mc, time.Now()); again != act {
			return
		}
		m.log.Info("vm lifetime: deleting", "vm", mc.id, "reason", why)
		if err := m.Delete(context.Background(), mc.id); err != nil {
			if apierr.CodeOf(err) != apierr.NotFound {
				m.log.Warn("vm lifetime: delete failed; tried again", "vm", mc.id, "error", err)
			}
			return
		}
		m.activity.lifetimeActs[act].Add(1)
		return
	}
	mc.op.Lock()
	defer mc.op.Unlock()
	if _, err := m.table.get(mc.id); err != nil {
		return
	}
	if again, _ := m.activity.due(mc, time.Now()); again != act {
		return
	}
	// An expiry is carried out once: a start afterwards runs unbounded until
	// a new one is set. It is cleared in the write that makes the VM
	// stopping, which a restarted hypervisor carries on with.
	consume := func(r *storepb.VirtualMachine) {
		if lt := r.GetLifetime(); act == actExpiredStop && lt != nil {
			lt.ExpireAt, lt.OnExpire = nil, hypervisorv1.OnExpire_ON_EXPIRE_UNSPECIFIED
			if lt.GetIdleTimeout() == "" {
				r.Lifetime = nil
			}
		}
	}
	mc.mu.Lock()
	rt, state := mc.run, mc.rec.GetState()
	// A suspended VM's expiry stops it as stop_vm does: its saved state is
	// discarded.
	stoppable := (isLive(state) && state != hypervisorv1.State_STATE_STOPPING) || state == hypervisorv1.State_STATE_SUSPENDED
	if state == hypervisorv1.State_STATE_SUSPENDED {
		clear := consume
		consume = func(r *storepb.VirtualMachine) {
			clear(r)
			r.LastError = why + "; the saved state was discarded"
		}
	}
	if rt != nil && stoppable {
		rt.stopReason = why
	}
	mc.mu.Unlock()
	if !stoppable {
		// Already down: nothing to stop. Still creating or stopping: the
		// next check sees how it ends.
		if state == hypervisorv1.State_STATE_STOPPED || state == hypervisorv1.State_STATE_FAILED {
			m.table.update(mc, consume)
		}
		return
	}
	m.log.Info("vm lifetime: stopping", "vm", mc.id, "reason", why)
	if err := m.stopLockedWith(mc, consume); err != nil {
		m.log.Warn("vm lifetime: stop failed; tried again", "vm", mc.id, "error", err)
		return
	}
	m.activity.lifetimeActs[act].Add(1)
}

// idleSuspend suspends an idle VM (on_idle: suspend), once more checking
// that it is still due; a suspend that fails leaves it running, and the
// next check tries again.
func (m *Manager) idleSuspend(mc *machine, why string) {
	if again, _ := m.activity.due(mc, time.Now()); again != actIdleSuspend {
		return
	}
	m.log.Info("vm lifetime: suspending", "vm", mc.id, "reason", why)
	if _, err := m.Suspend(context.Background(), mc.id); err != nil {
		if apierr.CodeOf(err) != apierr.NotFound {
			m.log.Warn("vm lifetime: suspend failed; tried again", "vm", mc.id, "error", err)
		}
		return
	}
	m.table.update(mc, func(r *storepb.VirtualMachine) {
		if r.GetState() == hypervisorv1.State_STATE_SUSPENDED {
			r.LastError = why
		}
	})
	m.activity.lifetimeActs[actIdleSuspend].Add(1)
}

// persistActivity writes a VM's last activity to the store now and then
// (touch keeps it in memory): at most once per persistEvery, so traffic
// does not turn into a write per second.
func (ac *Activity) persistActivity(mc *machine) {
	touched := mc.touched.Load()
	if touched == 0 || touched == mc.persisted.Load() {
		return
	}
	mc.mu.Lock()
	idle, _ := time.ParseDuration(mc.rec.GetLifetime().GetIdleTimeout())
	mc.mu.Unlock()
	every := min(time.Minute, idle/4)
	if idle <= 0 || time.Duration(touched-mc.persisted.Load())*time.Second < every {
		return
	}
	mc.persisted.Store(touched)
	ac.table.update(mc, func(*storepb.VirtualMachine) {})
}
