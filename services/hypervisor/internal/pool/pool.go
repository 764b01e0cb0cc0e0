// Package pool keeps the warm pools: named sets of VMs of one shape that
// booted, passed their initrd attestation and were suspended while their
// guest waits for its user-data, so that a create of that shape claims one
// and resumes it (vm/pool.go) instead of booting. It holds the pools'
// definitions (stored), their counters, and the refill loop that boots
// members in the background, at most Concurrency at a time and within a
// disk quota.
package pool

import (
	"context"
	"fmt"
	"io/fs"
	"log/slog"
	"path/filepath"
	"regexp"
	"slices"
	"sync"
	"syscall"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Store persists the pools' definitions.
type Store interface {
	ListPools() ([]*storepb.Pool, error)
	PutPool(*storepb.Pool) error
	DeletePool(name string) error
}

// VMs make, park and remove members (vm.Manager).
type VMs interface {
	PoolShape(req *hypervisorv1.CreatePoolRequest) (*hypervisorv1.PoolShape, error)
	CreateMember(ctx context.Context, pool string, shape *hypervisorv1.PoolShape) (string, error)
	WaitParked(ctx context.Context, id string) error
	Park(ctx context.Context, id string) error
	Members(pool string) []vm.Member
	Delete(ctx context.Context, id string) error
}

// Config bounds the pools.
type Config struct {
	// MaxPools and MaxSize bound the definitions (--max-pools,
	// --max-pool-size).
	MaxPools, MaxSize int
	// DiskBytes is what all members' directories may hold together
	// (--pool-disk-bytes); a refill is refused at it, and counted.
	DiskBytes int64
	// Concurrency is how many members boot at a time (--pool-refill-concurrency).
	Concurrency int
	// ParkTimeout bounds a member's boot to its park.
	ParkTimeout time.Duration
	// Retry is how long a pool waits after a failed refill.
	Retry time.Duration
}

// The defaults of the bounds.
const (
	DefaultMaxPools  = 16
	DefaultMaxSize   = 16
	DefaultDiskBytes = 20 << 30
)

func (c *Config) defaults() {
	if c.MaxPools <= 0 {
		c.MaxPools = DefaultMaxPools
	}
	if c.MaxSize <= 0 {
		c.MaxSize = DefaultMaxSize
	}
	if c.DiskBytes <= 0 {
		c.DiskBytes = DefaultDiskBytes
	}
	if c.Concurrency <= 0 {
		c.Concurrency = 1
	}
	if c.ParkTimeout <= 0 {
		c.ParkTimeout = 5 * time.Minute
	}
	if c.Retry <= 0 {
		c.Retry = 30 * time.Second
	}
}

// counters are a pool's since the hypervisor started.
type counters struct {
	hits, misses, refills, failures uint64
	refillSeconds                   float64
	lastError                       string
	retryAt                         time.Time
	filling                         map[string]bool // members booting toward their park
}

// Pools are the warm pools of this host.
type Pools struct {
	cfg   Config
	log   *slog.Logger
	store Store

	mu       sync.Mutex
	defs     map[string]*storepb.Pool
	counts   map[string]*counters
	vms      VMs
	busy     int // refills running
	diskUsed int64
	refused  uint64 // refills refused at the disk quota
	// deleting are pools whose Delete is deleting their members: the
	// refill loop leaves those members to it (they are not orphans of a
	// crash), so its count is whole.
	deleting map[string]bool

	kick chan struct{}
	wg   sync.WaitGroup
}

var name = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]*[a-z0-9])?$`)

// New loads the stored pools; nothing is refilled until Run.
func New(cfg Config, log *slog.Logger, st Store) (*Pools, error) {
	cfg.defaults()
	defs, err := st.ListPools()
	if err != nil {
		return nil, fmt.Errorf("load pools: %w", err)
	}
	p := &Pools{cfg: cfg, log: log, store: st, defs: map[string]*storepb.Pool{}, counts: map[string]*counters{}, kick: make(chan struct{}, 1)}
	for _, d := range defs {
		p.defs[d.GetName()] = d
		p.counts[d.GetName()] = &counters{filling: map[string]bool{}}
	}
	return p, nil
}

// Match names the pool whose shape is s (vm.Pools).
func (p *Pools) Match(s *hypervisorv1.PoolShape) (string, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for n, d := range p.defs {
		if proto.Equal(d.GetShape(), s) {
			return n, true
		}
	}
	return "", false
}

// Counted records a hit or a miss of pool, and starts its refill (vm.Pools).
func (p *Pools) Counted(pool string, hit bool) {
	p.mu.Lock()
	if c := p.counts[pool]; c != nil {
		if hit {
			c.hits++
		} else {
			c.misses++
		}
	}
	p.mu.Unlock()
	p.wake()
}

func (p *Pools) wake() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// Create defines a pool; its members boot in the background.
func (p *Pools) Create(req *hypervisorv1.CreatePoolRequest) (*hypervisorv1.Pool, error) {
	if n := req.GetName(); len(n) > 63 || !name.MatchString(n) {
		return nil, apierr.Invalidf("name", "pool name %q is not a DNS label (lower-case letters, digits and '-', at most 63 characters)", n)
	}
	if err := p.checkSize(req.GetSize()); err != nil {
		return nil, err
	}
	vms := p.members()
	if vms == nil {
		return nil, apierr.Errorf(apierr.Unavailable, "the pools are not running yet")
	}
	shape, err := vms.PoolShape(req)
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	if _, ok := p.defs[req.GetName()]; ok {
		p.mu.Unlock()
		return nil, apierr.Errorf(apierr.Conflict, "pool %q exists", req.GetName())
	}
	for n, d := range p.defs {
		if proto.Equal(d.GetShape(), shape) {
			p.mu.Unlock()
			return nil, apierr.Errorf(apierr.Conflict, "pool %q has this shape already: resize it instead", n)
		}
	}
	if len(p.defs) >= p.cfg.MaxPools {
		p.mu.Unlock()
		return nil, apierr.Errorf(apierr.ResourceExhausted, "this host has %d pools, the maximum is %d (--max-pools)", len(p.defs), p.cfg.MaxPools)
	}
	d := &storepb.Pool{Name: req.GetName(), Shape: shape, Size: req.GetSize(), CreatedAt: timestamppb.Now()}
	if err := p.store.PutPool(d); err != nil {
		p.mu.Unlock()
		return nil, err
	}
	p.defs[d.GetName()] = d
	p.counts[d.GetName()] = &counters{filling: map[string]bool{}}
	p.mu.Unlock()
	p.log.Info("pool created", "pool", d.GetName(), "size", d.GetSize(), "image", shape.GetImage())
	p.wake()
	return p.Get(d.GetName())
}

func (p *Pools) checkSize(n int32) error {
	if n < 0 || int(n) > p.cfg.MaxSize {
		return apierr.Invalidf("size", "size %d is not within 0..%d (--max-pool-size)", n, p.cfg.MaxSize)
	}
	return nil
}

func (p *Pools) members() VMs {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.vms
}

// Resize changes how many members pool keeps; a shrink deletes the ready
// members beyond the size (booting ones finish and are deleted next pass).
func (p *Pools) Resize(ctx context.Context, pool string, size int32) (*hypervisorv1.Pool, error) {
	if err := p.checkSize(size); err != nil {
		return nil, err
	}
	p.mu.Lock()
	d, ok := p.defs[pool]
	if !ok {
		p.mu.Unlock()
		return nil, apierr.Errorf(apierr.NotFound, "pool %q not found", pool)
	}
	next := proto.Clone(d).(*storepb.Pool)
	next.Size = size
	if err := p.store.PutPool(next); err != nil {
		p.mu.Unlock()
		return nil, err
	}
	p.defs[pool] = next
	p.mu.Unlock()
	p.trim(ctx, pool)
	p.wake()
	return p.Get(pool)
}

// Delete removes pool and its unclaimed members.
func (p *Pools) Delete(ctx context.Context, pool string) (*hypervisorv1.DeletePoolResponse, error) {
	p.mu.Lock()
	if _, ok := p.defs[pool]; !ok {
		p.mu.Unlock()
		return nil, apierr.Errorf(apierr.NotFound, "pool %q not found", pool)
	}
	if err := p.store.DeletePool(pool); err != nil {
		p.mu.Unlock()
		return nil, err
	}
	delete(p.defs, pool)
	if p.deleting == nil {
		p.deleting = map[string]bool{}
	}
	p.deleting[pool] = true
	vms := p.vms
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.deleting, pool)
		p.mu.Unlock()
	}()
	n := 0
	if vms != nil {
		for _, mb := range vms.Members(pool) {
			if err := vms.Delete(ctx, mb.ID); err == nil {
				n++
			} else if apierr.CodeOf(err) != apierr.NotFound {
				p.log.Warn("delete a member of a deleted pool", "pool", pool, "vm", mb.ID, "error", err)
			}
		}
	}
	p.log.Info("pool deleted", "pool", pool, "members_deleted", n)
	return &hypervisorv1.DeletePoolResponse{Name: pool, Deleted: true, MembersDeleted: int32(n)}, nil
}

// trim deletes ready members beyond the size, newest first.
func (p *Pools) trim(ctx context.Context, pool string) {
	p.mu.Lock()
	d, vms := p.defs[pool], p.vms
	p.mu.Unlock()
	if d == nil || vms == nil {
		return
	}
	ms := vms.Members(pool)
	for i := len(ms) - 1; i >= 0 && len(ms) > int(d.GetSize()); i-- {
		if ms[i].State != hypervisorv1.State_STATE_SUSPENDED {
			continue
		}
		if err := vms.Delete(ctx, ms[i].ID); err != nil {
			p.log.Warn("delete a member beyond the pool's size", "pool", pool, "vm", ms[i].ID, "error", err)
			continue
		}
		ms = slices.Delete(ms, i, i+1)
	}
}

// Get is one pool with its status.
func (p *Pools) Get(pool string) (*hypervisorv1.Pool, error) {
	p.mu.Lock()
	d, ok := p.defs[pool]
	p.mu.Unlock()
	if !ok {
		return nil, apierr.Errorf(apierr.NotFound, "pool %q not found", pool)
	}
	return p.view(d), nil
}

// List is every pool, sorted by name.
func (p *Pools) List() []*hypervisorv1.Pool {
	p.mu.Lock()
	defs := make([]*storepb.Pool, 0, len(p.defs))
	for _, d := range p.defs {
		defs = append(defs, d)
	}
	p.mu.Unlock()
	slices.SortFunc(defs, func(a, b *storepb.Pool) int {
		if a.GetName() < b.GetName() {
			return -1
		}
		return 1
	})
	out := make([]*hypervisorv1.Pool, len(defs))
	for i, d := range defs {
		out[i] = p.view(d)
	}
	return out
}

func (p *Pools) view(d *storepb.Pool) *hypervisorv1.Pool {
	st := &hypervisorv1.PoolStatus{}
	vms := p.members()
	if vms != nil {
		for _, mb := range vms.Members(d.GetName()) {
			b := dirBytes(mb.Dir)
			st.Members = append(st.Members, &hypervisorv1.PoolMember{VmId: mb.ID, State: mb.State, DiskBytes: b})
			st.DiskBytes += b
			if mb.State == hypervisorv1.State_STATE_SUSPENDED {
				st.Ready++
			} else {
				st.Filling++
			}
		}
	}
	p.mu.Lock()
	if c := p.counts[d.GetName()]; c != nil {
		st.HitsTotal, st.MissesTotal, st.RefillsTotal, st.RefillFailuresTotal = c.hits, c.misses, c.refills, c.failures
		st.RefillSecondsTotal, st.LastError = c.refillSeconds, c.lastError
	}
	p.mu.Unlock()
	return &hypervisorv1.Pool{Name: d.GetName(), Shape: proto.Clone(d.GetShape()).(*hypervisorv1.PoolShape), Size: d.GetSize(), Status: st, CreatedAt: d.GetCreatedAt()}
}

// RefusedAtDiskQuota counts the refills refused at --pool-disk-bytes.
func (p *Pools) RefusedAtDiskQuota() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.refused
}

// dirBytes is what a directory holds on disk (allocated blocks: a sparse
// disk counts what it uses).
func dirBytes(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, e fs.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			return nil
		}
		if fi, err := e.Info(); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				n += st.Blocks * 512
			}
		}
		return nil
	})
	return n
}
