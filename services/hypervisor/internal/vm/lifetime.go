package vm

import (
	"context"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/bound"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/lifecycle"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Lifetimes bound when VMs end by themselves (docs/api.md "Lifetimes").
type Lifetimes struct {
	// DefaultTTL is the expiry of a VM created without ttl or expire_at
	// (--default-vm-ttl); 0: none, a VM lives until deleted (the original's
	// behaviour).
	DefaultTTL time.Duration
	// MaxTTL bounds how far ahead an expiry may be set (--max-vm-ttl).
	MaxTTL time.Duration
	// Tick is how often expiries and idle timeouts are checked: the
	// accuracy of both (1s; tests may shorten it).
	Tick time.Duration
}

// Bounds and defaults of lifetimes.
const (
	DefaultMaxTTL  = 30 * 24 * time.Hour
	MinIdleTimeout = 10 * time.Second
	// minTTL keeps an expiry from being in the past by the time it is stored.
	minTTL = time.Second
)

func (l *Lifetimes) defaults() {
	bound.Default(&l.MaxTTL, DefaultMaxTTL)
	bound.Default(&l.Tick, time.Second)
}

// Activity kinds: what restarted a VM's idle clock.
const (
	ActivityExec     = "exec"
	ActivityForward  = "forward"
	ActivityIMDS     = "imds"
	ActivityStart    = "start"
	ActivityResume   = "resume"
	ActivityLifetime = "lifetime" // idle_timeout set or changed
	ActivityRestart  = "restart"  // the hypervisor started
)

// expiry parses ttl or expire_at (one of them at most) into a time; zero
// when neither is given.
func (l Lifetimes) expiry(ttl string, at *timestamppb.Timestamp, now time.Time) (time.Time, error) {
	switch {
	case ttl != "" && at != nil:
		return time.Time{}, apierr.Invalidf("ttl", "give ttl or expire_at, not both")
	case ttl != "":
		d, err := time.ParseDuration(ttl)
		if err != nil {
			return time.Time{}, apierr.Invalidf("ttl", "ttl %q is not a duration such as \"60s\", \"30m\" or \"2h\"", ttl)
		}
		if d < minTTL || d > l.MaxTTL {
			return time.Time{}, apierr.Invalidf("ttl", "ttl %s is not within %s..%s (--max-vm-ttl)", d, minTTL, l.MaxTTL)
		}
		return now.Add(d), nil
	case at != nil:
		if err := at.CheckValid(); err != nil {
			return time.Time{}, apierr.Invalidf("expire_at", "expire_at is not a valid time: %v", err)
		}
		t := at.AsTime()
		if d := t.Sub(now); d < minTTL || d > l.MaxTTL {
			return time.Time{}, apierr.Invalidf("expire_at", "expire_at %s is not between %s and %s from now (--max-vm-ttl)", t.Format(time.RFC3339), minTTL, l.MaxTTL)
		}
		return t, nil
	}
	return time.Time{}, nil
}

// idleTimeout parses an idle timeout; "0" or "0s" is none.
func (l Lifetimes) idleTimeout(s string) (time.Duration, error) {
	if s == "" {
		return 0, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, apierr.Invalidf("idle_timeout", "idle_timeout %q is not a duration such as \"10m\"", s)
	}
	if d != 0 && (d < MinIdleTimeout || d > l.MaxTTL) {
		return 0, apierr.Invalidf("idle_timeout", "idle_timeout %s is not within %s..%s (--max-vm-ttl), or 0 for none", d, MinIdleTimeout, l.MaxTTL)
	}
	return d, nil
}

func checkOnExpire(v hypervisorv1.OnExpire) error {
	if _, ok := hypervisorv1.OnExpire_name[int32(v)]; !ok {
		return apierr.Invalidf("on_expire", "on_expire %d is not stop or delete", v)
	}
	return nil
}

func checkOnIdle(v hypervisorv1.OnIdle) error {
	if _, ok := hypervisorv1.OnIdle_name[int32(v)]; !ok {
		return apierr.Invalidf("on_idle", "on_idle %d is not stop or suspend", v)
	}
	return nil
}

// createLifetime is a create request's lifetime, nil when it has none.
func (l Lifetimes) createLifetime(req *hypervisorv1.CreateVirtualMachineRequest, now time.Time) (*hypervisorv1.Lifetime, error) {
	exp, err := l.expiry(req.GetTtl(), req.GetExpireAt(), now)
	if err != nil {
		return nil, err
	}
	if exp.IsZero() && l.DefaultTTL > 0 {
		exp = now.Add(l.DefaultTTL)
	}
	if err := checkOnExpire(req.GetOnExpire()); err != nil {
		return nil, err
	}
	if exp.IsZero() && req.GetOnExpire() != hypervisorv1.OnExpire_ON_EXPIRE_UNSPECIFIED {
		return nil, apierr.Invalidf("on_expire", "on_expire needs ttl or expire_at")
	}
	idle, err := l.idleTimeout(req.GetIdleTimeout())
	if err != nil {
		return nil, err
	}
	if err := checkOnIdle(req.GetOnIdle()); err != nil {
		return nil, err
	}
	if idle == 0 && req.GetOnIdle() != hypervisorv1.OnIdle_ON_IDLE_UNSPECIFIED {
		return nil, apierr.Invalidf("on_idle", "on_idle needs idle_timeout")
	}
	if exp.IsZero() && idle == 0 {
		return nil, nil
	}
	lt := &hypervisorv1.Lifetime{}
	setExpiry(lt, exp, req.GetOnExpire())
	setIdle(lt, idle, req.GetOnIdle(), now)
	return lt, nil
}

// setExpiry sets (or, for a zero time, clears) lt's expiry; an unspecified
// action keeps lt's, stop by default.
func setExpiry(lt *hypervisorv1.Lifetime, exp time.Time, on hypervisorv1.OnExpire) {
	if on != hypervisorv1.OnExpire_ON_EXPIRE_UNSPECIFIED {
		lt.OnExpire = on
	}
	if exp.IsZero() {
		lt.ExpireAt, lt.OnExpire = nil, hypervisorv1.OnExpire_ON_EXPIRE_UNSPECIFIED
		return
	}
	lt.ExpireAt = timestamppb.New(exp)
	if lt.OnExpire == hypervisorv1.OnExpire_ON_EXPIRE_UNSPECIFIED {
		lt.OnExpire = hypervisorv1.OnExpire_ON_EXPIRE_STOP
	}
}

// setIdle sets (or, for 0, clears) lt's idle timeout; its clock starts now.
func setIdle(lt *hypervisorv1.Lifetime, idle time.Duration, on hypervisorv1.OnIdle, now time.Time) {
	if on != hypervisorv1.OnIdle_ON_IDLE_UNSPECIFIED {
		lt.OnIdle = on
	}
	if idle == 0 {
		lt.IdleTimeout, lt.OnIdle, lt.LastActivityAt, lt.LastActivity = "", hypervisorv1.OnIdle_ON_IDLE_UNSPECIFIED, nil, ""
		return
	}
	lt.IdleTimeout = idle.String()
	if lt.OnIdle == hypervisorv1.OnIdle_ON_IDLE_UNSPECIFIED {
		lt.OnIdle = hypervisorv1.OnIdle_ON_IDLE_STOP
	}
	lt.LastActivityAt, lt.LastActivity = timestamppb.New(now), ActivityLifetime
}

// UpdateLifetime extends, shortens or clears a VM's expiry and changes its
// actions or idle timeout; the fields left out keep their values.
func (ac *Activity) UpdateLifetime(_ context.Context, req *hypervisorv1.UpdateVirtualMachineLifetimeRequest) (*hypervisorv1.VirtualMachine, error) {
	now := time.Now()
	l := ac.cfg.Lifetimes
	if req.GetClearExpiry() && (req.GetTtl() != "" || req.GetExpireAt() != nil) {
		return nil, apierr.Invalidf("clear_expiry", "give ttl, expire_at or clear_expiry, not several")
	}
	if req.GetClearExpiry() && l.DefaultTTL > 0 {
		return nil, apierr.Invalidf("clear_expiry", "every VM on this host expires (--default-vm-ttl %s): give ttl or expire_at instead", l.DefaultTTL)
	}
	exp, err := l.expiry(req.GetTtl(), req.GetExpireAt(), now)
	if err != nil {
		return nil, err
	}
	if err := checkOnExpire(req.GetOnExpire()); err != nil {
		return nil, err
	}
	if err := checkOnIdle(req.GetOnIdle()); err != nil {
		return nil, err
	}
	var idle time.Duration
	if req.IdleTimeout != nil {
		if idle, err = l.idleTimeout(req.GetIdleTimeout()); err != nil {
			return nil, err
		}
		if req.GetIdleTimeout() == "" {
			return nil, apierr.Invalidf("idle_timeout", "idle_timeout is empty: give a duration, or \"0s\" for none")
		}
	}
	mc, err := ac.table.get(req.GetId())
	if err != nil {
		return nil, err
	}
	mc.mu.Lock()
	defer mc.mu.Unlock()
	if mc.rec.GetState() == hypervisorv1.State_STATE_DELETING {
		return nil, apierr.Errorf(apierr.Conflict, "vm %s is %s", mc.id, lifecycle.Name(mc.rec.GetState()))
	}
	lt := &hypervisorv1.Lifetime{}
	if cur := mc.rec.GetLifetime(); cur != nil {
		lt = proto.Clone(cur).(*hypervisorv1.Lifetime)
	}
	switch {
	case req.GetClearExpiry():
		setExpiry(lt, time.Time{}, hypervisorv1.OnExpire_ON_EXPIRE_UNSPECIFIED)
	case !exp.IsZero():
		setExpiry(lt, exp, req.GetOnExpire())
	case req.GetOnExpire() != hypervisorv1.OnExpire_ON_EXPIRE_UNSPECIFIED:
		if lt.GetExpireAt() == nil {
			return nil, apierr.Invalidf("on_expire", "vm %s has no expiry: give ttl or expire_at with on_expire", mc.id)
		}
		lt.OnExpire = req.GetOnExpire()
	}
	switch {
	case req.IdleTimeout != nil:
		setIdle(lt, idle, req.GetOnIdle(), now)
	case req.GetOnIdle() != hypervisorv1.OnIdle_ON_IDLE_UNSPECIFIED:
		if lt.GetIdleTimeout() == "" {
			return nil, apierr.Invalidf("on_idle", "vm %s has no idle_timeout: give idle_timeout with on_idle", mc.id)
		}
		lt.OnIdle = req.GetOnIdle()
	}
	if lt.GetExpireAt() == nil && lt.GetIdleTimeout() == "" {
		lt = nil
	}
	rec := ac.table.updateLocked(mc, func(r *storepb.VirtualMachine) { r.Lifetime = lt })
	ac.log.Info("vm lifetime", "vm", mc.id, "expire_at", lt.GetExpireAt().AsTime(), "on_expire", lt.GetOnExpire(), "idle_timeout", lt.GetIdleTimeout())
	return View(rec), nil
}

// Touch restarts a VM's idle clock: some traffic reached it (reason: one
// of the Activity kinds). Cheap enough for every read of a forwarded
// connection: the record is looked at at most once a second.
func (ac *Activity) Touch(id, reason string) {
	if mc, err := ac.table.get(id); err == nil {
		ac.touch(mc, reason)
	}
}

func (ac *Activity) touch(mc *machine, reason string) {
	now := time.Now()
	if mc.touched.Swap(now.Unix()) == now.Unix() {
		return
	}
	mc.mu.Lock()
	defer mc.mu.Unlock()
	if lt := mc.rec.GetLifetime(); lt.GetIdleTimeout() != "" {
		// In memory only: the lifetime loop persists it now and then.
		lt.LastActivityAt, lt.LastActivity = timestamppb.New(now), reason
	}
}

// restartIdleClock starts a loaded VM's idle clock at the hypervisor's
// start: while it was down nothing could reach the VM through it, and that
// is not held against the VM.
func (ac *Activity) restartIdleClock(mc *machine) {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	if lt := mc.rec.GetLifetime(); lt.GetIdleTimeout() != "" && lt.GetLastActivityAt().AsTime().Before(ac.started) {
		lt.LastActivityAt, lt.LastActivity = timestamppb.New(ac.started), ActivityRestart
	}
}

// Hold keeps a VM from being idle until release is called (an exec session
// that is open, however quiet): it counts as activity when it begins and
// when it ends.
func (ac *Activity) Hold(id, reason string) (release func()) {
	mc, err := ac.table.get(id)
	if err != nil {
		return func() {}
	}
	mc.holds.Add(1)
	ac.touch(mc, reason)
	return func() {
		mc.touched.Store(0) // the end counts even within the same second
		ac.touch(mc, reason)
		mc.holds.Add(-1)
	}
}
