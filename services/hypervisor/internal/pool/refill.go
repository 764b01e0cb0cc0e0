package pool

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vm"
)

// passInterval is how often the refill loop looks at the pools without
// being woken (a member that failed, a retry that is due).
const passInterval = 5 * time.Second

// Run refills the pools with vms until ctx ends, then waits for the refills
// under way. Called once, after the VM manager's restore.
func (p *Pools) Run(ctx context.Context, vms VMs) {
	p.mu.Lock()
	p.vms = vms
	p.mu.Unlock()
	tick := time.NewTicker(passInterval)
	defer tick.Stop()
	for {
		p.pass(ctx)
		select {
		case <-ctx.Done():
			p.wg.Wait()
			return
		case <-p.kick:
		case <-tick.C:
		}
	}
}

// pass removes members that will not become ready, parks the members a
// previous hypervisor left booting, and starts refills while the budget
// and the disk quota allow.
func (p *Pools) pass(ctx context.Context) {
	p.mu.Lock()
	names := make([]string, 0, len(p.defs))
	for n := range p.defs {
		names = append(names, n)
	}
	deleting := maps.Clone(p.deleting)
	vms := p.vms
	p.mu.Unlock()
	slices.Sort(names)
	for _, mb := range vms.Members("") {
		if !slices.Contains(names, mb.Pool) && !deleting[mb.Pool] {
			// Its pool was deleted by a hypervisor killed before it deleted
			// the members.
			p.log.Info("deleting a member of a deleted pool", "pool", mb.Pool, "vm", mb.ID)
			if err := vms.Delete(ctx, mb.ID); err != nil {
				p.log.Warn("delete a member of a deleted pool", "pool", mb.Pool, "vm", mb.ID, "error", err)
			}
		}
	}
	used := int64(0)
	members := map[string][]vm.Member{}
	for _, n := range names {
		members[n] = vms.Members(n)
		for _, mb := range members[n] {
			used += dirBytes(mb.Dir)
		}
	}
	p.mu.Lock()
	p.diskUsed = used
	p.mu.Unlock()
	for _, n := range names {
		for _, mb := range members[n] {
			p.tend(ctx, n, mb)
		}
		p.trim(ctx, n)
		for p.refillDue(n, len(vms.Members(n))) {
			if !p.startRefill(ctx, n) {
				break
			}
		}
	}
}

// tend deletes a member that stopped or failed, and parks one that no
// refill of this process is waiting for (a previous hypervisor's).
func (p *Pools) tend(ctx context.Context, pool string, mb vm.Member) {
	p.mu.Lock()
	c := p.counts[pool]
	filling := c != nil && c.filling[mb.ID]
	p.mu.Unlock()
	if filling {
		return
	}
	switch mb.State {
	case hypervisorv1.State_STATE_SUSPENDED, hypervisorv1.State_STATE_SUSPENDING:
	case hypervisorv1.State_STATE_STOPPED, hypervisorv1.State_STATE_FAILED:
		p.log.Warn("deleting a pool member that stopped", "pool", pool, "vm", mb.ID, "state", mb.State)
		if err := p.vms.Delete(ctx, mb.ID); err != nil {
			p.log.Warn("delete a stopped member", "pool", pool, "vm", mb.ID, "error", err)
		}
	case hypervisorv1.State_STATE_DELETING:
	default:
		// Booting when the hypervisor restarted: park it as a refill would.
		p.mu.Lock()
		c.filling[mb.ID] = true
		p.busy++
		p.mu.Unlock()
		p.wg.Go(func() { p.finish(ctx, pool, mb.ID, time.Now()) })
	}
}

// refillDue says whether pool lacks members, no retry is pending and the
// boot budget has room.
func (p *Pools) refillDue(pool string, have int) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	d, c := p.defs[pool], p.counts[pool]
	if d == nil || c == nil || have >= int(d.GetSize()) || p.busy >= p.cfg.Concurrency {
		return false
	}
	return time.Now().After(c.retryAt)
}

// startRefill boots one member of pool in the background; false when the
// disk quota refused it.
func (p *Pools) startRefill(ctx context.Context, pool string) bool {
	p.mu.Lock()
	d, c := p.defs[pool], p.counts[pool]
	if p.diskUsed >= p.cfg.DiskBytes {
		p.refused++
		c.lastError = fmt.Sprintf("the pools' members hold %d bytes, the quota is %d (--pool-disk-bytes): not refilled", p.diskUsed, p.cfg.DiskBytes)
		c.retryAt = time.Now().Add(p.cfg.Retry)
		p.mu.Unlock()
		time.AfterFunc(p.cfg.Retry, p.wake)
		p.log.Warn("pool refill refused at the disk quota", "pool", pool, "used", p.diskUsed, "quota", p.cfg.DiskBytes)
		return false
	}
	p.busy++
	shape := d.GetShape()
	p.mu.Unlock()
	start := time.Now()
	id, err := p.vms.CreateMember(ctx, pool, shape)
	if err != nil {
		p.failed(pool, "", fmt.Errorf("boot a member: %w", err))
		return false
	}
	p.mu.Lock()
	c.filling[id] = true
	p.mu.Unlock()
	p.log.Info("pool refill started", "pool", pool, "vm", id)
	p.wg.Go(func() { p.finish(ctx, pool, id, start) })
	return true
}

// finish waits until member id waits for its user-data after a verified
// initrd quote, then parks it; a member that does not get there is
// deleted and the failure recorded.
func (p *Pools) finish(ctx context.Context, pool, id string, start time.Time) {
	wctx, cancel := context.WithTimeout(ctx, p.cfg.ParkTimeout)
	err := p.vms.WaitParked(wctx, id)
	cancel()
	if err == nil {
		err = p.vms.Park(ctx, id)
	}
	if ctx.Err() != nil {
		// The hypervisor stops: the next one parks the member (tend).
		p.release(pool, id)
		return
	}
	if err != nil {
		if derr := p.vms.Delete(context.WithoutCancel(ctx), id); derr != nil {
			p.log.Warn("delete a member that failed", "pool", pool, "vm", id, "error", derr)
		}
		p.failed(pool, id, err)
		return
	}
	p.mu.Lock()
	if c := p.counts[pool]; c != nil {
		c.refills++
		c.refillSeconds += time.Since(start).Seconds()
		c.lastError = ""
	}
	p.mu.Unlock()
	p.release(pool, id)
	p.log.Info("pool member ready", "pool", pool, "vm", id, "seconds", time.Since(start).Seconds())
	p.wake()
}

func (p *Pools) release(pool, id string) {
	p.mu.Lock()
	if c := p.counts[pool]; c != nil {
		delete(c.filling, id)
	}
	p.busy--
	p.mu.Unlock()
	time.AfterFunc(p.cfg.Retry, p.wake)
}

// failed records a refill that did not give a member; the pool waits
// Retry before the next one.
func (p *Pools) failed(pool, id string, err error) {
	p.log.Warn("pool refill failed", "pool", pool, "vm", id, "error", err)
	p.mu.Lock()
	if c := p.counts[pool]; c != nil {
		c.failures++
		c.lastError = err.Error()
		c.retryAt = time.Now().Add(p.cfg.Retry)
		if id != "" {
			delete(c.filling, id)
		}
	}
	p.busy--
	p.mu.Unlock()
	time.AfterFunc(p.cfg.Retry, p.wake)
}
