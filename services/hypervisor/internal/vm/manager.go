// Package vm is the VM lifecycle (contract §3): the stored records, create,
// start, stop, reboot and delete, readiness and timers, every boot's
// registration with attestation, guest resets, and the re-adoption of
// running VMs after a hypervisor restart. The processes are a Driver's
// (internal/driver), the networks the network registry's, what guests reach
// the guest side's (internal/guest); the legal state changes are the
// lifecycle package's.
//
// Locking: each VM has an operation mutex (op) serialising create, start,
// stop, reboot and delete, and a record mutex (mu) guarding the record and
// its runtime. Every change is checked, persisted, published and wakes all
// waiters (updateLocked).
package vm

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/forward"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/guestapi"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/lifecycle"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/network"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/notify"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/proto"
)

// Config is how VMs are run.
type Config struct {
	// StateDir holds vms/<id>/.
	StateDir string
	// ImageDir is the catalog, whose sysupdate/ tree guests may fetch.
	ImageDir string
	// Accelerator is what the host report chose (kvm or tcg), recorded on
	// every VM the driver runs with it.
	Accelerator hypervisorv1.Accelerator
	// Region is reported to guests; the host name by default.
	Region string
	// Firmware is the OVMF build VMs boot (from the host report), handed to
	// attestation so golden values name it.
	Firmware *hypervisorv1.Firmware
	// DefaultNetwork is created at start (from DefaultSubnet) when missing,
	// and is the network of a VM created without one. Empty: no default.
	DefaultNetwork string
	DefaultSubnet  string

	InstallTimeout time.Duration
	BootTimeout    time.Duration
	StopTimeout    time.Duration
	// KillGrace is the SIGTERM→SIGKILL grace.
	KillGrace time.Duration
	// GuestSeriesLimit is how many series of a guest's report are exported
	// (--metrics-guest-series-limit; guestapi.DefaultGuestSeriesLimit when 0).
	GuestSeriesLimit int
	// StopVMsOnExit powers VMs down when the hypervisor stops (a pod, whose
	// end kills its children anyway). By default they keep running for the
	// next hypervisor to re-adopt.
	StopVMsOnExit bool
	// Limits are the per-host and per-VM bounds.
	Limits Limits
	// IMDS are the per-VM bounds of the IMDS (request rate, body sizes).
	IMDS imds.Limits
	// ConsoleLogMaxBytes bounds each VM's console.log and console.log.1
	// together (--console-log-max-bytes); ConsoleCheckInterval is how often
	// their sizes are looked at (tests shorten it).
	ConsoleLogMaxBytes   int64
	ConsoleCheckInterval time.Duration
	// Network bounds what a VM can make its network hold (NAT flows, IMDS
	// connections); zero fields take the defaults.
	Network network.Limits
	// Lifetimes bound expiries and idle timeouts (lifetime.go).
	Lifetimes Lifetimes
	// Watch bounds the watch streams (watch.go).
	Watch WatchLimits
	// IDPrefix, in a fleet, is the node index as 3 hex characters: every VM
	// id starts with it, so the fleet gateway routes a call by the id alone.
	IDPrefix string
}

func (c *Config) defaults() {
	if c.InstallTimeout == 0 {
		c.InstallTimeout = 5 * time.Minute
	}
	if c.BootTimeout == 0 {
		c.BootTimeout = 4 * time.Minute
	}
	if c.StopTimeout == 0 {
		c.StopTimeout = 30 * time.Second
	}
	if c.KillGrace == 0 {
		c.KillGrace = 5 * time.Second
	}
	c.Limits.defaults()
	c.Lifetimes.defaults()
	c.Watch.defaults()
	if c.ConsoleLogMaxBytes <= 0 {
		c.ConsoleLogMaxBytes = DefaultConsoleLogMaxBytes
	}
}

// Store persists VM records.
type Store interface {
	GetVM(id string) (*storepb.VirtualMachine, error)
	PutVM(vm *storepb.VirtualMachine) error
	// DeleteVM also queues the VM for attestation to forget.
	DeleteVM(id string) error
	ListVMs() ([]*storepb.VirtualMachine, error)
	PendingForgets() ([]string, error)
	Forgotten(id string) error
	ListNetworks() ([]*hypervisorv1.Network, error)
	PutNetwork(n *hypervisorv1.Network) error
	DeleteNetwork(name string) error
}

// Manager runs VMs.
type Manager struct {
	cfg      Config
	log      *slog.Logger
	store    Store
	images   ImageResolver
	verifier attestationv1.VerifierServiceClient
	router   *notify.Router
	driver   Driver
	newID    func() string // random VM ids; tests pick their own

	ctx    context.Context // ends when the hypervisor stops
	cancel context.CancelFunc

	mu       sync.Mutex
	machines map[string]*machine
	// leases index the machines by address, for the IMDS's lookup of its
	// caller on every request (Leased).
	leases  map[lease]*machine
	nets    *network.Registry
	events  *lifecycle.Broker
	illegal atomic.Uint64
	guest   *guestapi.Side
	imds    *imds.Guard
	closing bool
	wg      sync.WaitGroup
	// startOnce guards RunLoops: the loops run once.
	startOnce sync.Once

	refused refusals
	// watchers are the watch streams (watch.go).
	watchers watchers
	// suspends counts suspends and resumes (suspend.go).
	suspends suspendStats
	// netCreate serialises network creates, so that two cannot both pass
	// the MaxNetworks check.
	netCreate sync.Mutex

	// Lifetimes (expire.go): when this hypervisor started (an idle clock
	// starts no earlier) and what they did.
	started      time.Time
	lifetimeActs lifetimeActions
	// lifetimePasses counts finished checks of every VM's lifetime: "nothing
	// happened" is a result only after a pass that looked.
	lifetimePasses atomic.Uint64
}

// lease is an address on a network: one VM's at a time.
type lease struct {
	network string
	ip      netip.Addr
}

// leaseOf is a record's lease; ok is false without one.
func leaseOf(rec *storepb.VirtualMachine) (lease, bool) {
	ip, err := netip.ParseAddr(rec.GetIp())
	if rec.GetNetwork() == "" || err != nil {
		return lease{}, false
	}
	return lease{rec.GetNetwork(), ip.Unmap()}, true
}

type machine struct {
	id string
	op sync.Mutex

	mu      sync.Mutex
	rec     *storepb.VirtualMachine
	run     *runtime
	fwd     map[int32]*forward.Forward // guest port -> listener
	changed chan struct{}
	resets  []time.Time // guest resets within GuestResetWindow
	console consoleCounters
	trace   trace.SpanContext // the call that started the current boot (trace.go)

	// Lifetimes (lifetime.go, expire.go): the last touch and the last
	// persisted one (unix seconds), open exec sessions, an action running.
	touched, persisted atomic.Int64
	holds              atomic.Int32
	acting             atomic.Bool
}

// New loads the records and re-adopts the VMs whose processes still run.
func New(cfg Config, log *slog.Logger, st Store, images ImageResolver, verifier attestationv1.VerifierServiceClient, router *notify.Router, driver Driver) (*Manager, error) {
	cfg.defaults()
	ctx, cancel := context.WithCancel(context.Background())
	m := &Manager{cfg: cfg, log: log, store: st, images: images, verifier: verifier, router: router, driver: driver, ctx: ctx, cancel: cancel,
		machines: map[string]*machine{}, leases: map[lease]*machine{}, newID: newID, started: time.Now()}
	m.watchers.ended = make(chan struct{})
	if p := cfg.IDPrefix; p != "" {
		m.newID = func() string { return p + newID()[len(p):] }
	}
	var err error
	if m.events, err = newEvents(st, cfg.Watch.Retain); err != nil {
		cancel()
		return nil, err
	}
	m.guest = guestapi.New(m, verifier, guestapi.Config{ImageDir: cfg.ImageDir, SeriesLimit: cfg.GuestSeriesLimit}, log)
	m.imds = imds.NewGuard(cfg.IMDS)
	m.nets = network.NewRegistry(ctx, st, func(name string) http.Handler {
		return m.activeIMDS(name, m.tracedIMDS(name, imds.New(m.guest.Network(name), m.imds, log.With("network", name))))
	}, cfg.Network, log)
	// Networks first: re-adopted VMs redial their network's socket.
	if err := m.nets.Restore(cfg.DefaultNetwork, cfg.DefaultSubnet); err != nil {
		cancel()
		return nil, err
	}
	recs, err := st.ListVMs()
	if err != nil {
		cancel()
		return nil, fmt.Errorf("load vm records: %w", err)
	}
	strays := m.driver.Strays()
	for _, rec := range recs {
		m.events.Seed(proto.Clone(rec).(*storepb.VirtualMachine)) // restore's changes are events after it
		mc := &machine{id: rec.GetId(), rec: rec, changed: make(chan struct{})}
		m.machines[mc.id] = mc
		if l, ok := leaseOf(rec); ok {
			m.leases[l] = mc
		}
		m.restore(mc, strays[mc.id])
		m.restartIdleClock(mc)
		m.restoreForwards(mc)
		delete(strays, mc.id)
	}
	for id, procs := range strays { // of VM directories without a record
		m.endStrays(id, procs, nil)
	}
	m.sweepDeleted()
	return m, nil
}

// RunLoops runs the background loops: forgetting deleted records, rotating
// consoles, carrying out lifetimes. New starts none of them, so that what
// configures a Manager (the server, a test) is done before anything reads it
// concurrently. Later calls do nothing.
func (m *Manager) RunLoops() {
	m.startOnce.Do(func() {
		m.wg.Go(m.forgetLoop)
		m.wg.Go(m.consoleLoop)
		m.wg.Go(m.lifetimeLoop)
	})
}

func (m *Manager) vmDir(id string) string { return filepath.Join(m.cfg.StateDir, "vms", id) }

func (m *Manager) get(id string) (*machine, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if mc, ok := m.machines[id]; ok && vmID.MatchString(id) {
		return mc, nil
	}
	return nil, apierr.Errorf(apierr.NotFound, "vm %q not found", id)
}

// snapshot returns a copy of the record and the channel closed on its next change.
func (mc *machine) snapshot() (*storepb.VirtualMachine, <-chan struct{}) {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	return proto.Clone(mc.rec).(*storepb.VirtualMachine), mc.changed
}

// update applies fn to the record under its lock, persists it and wakes waiters.
func (m *Manager) update(mc *machine, fn func(rec *storepb.VirtualMachine)) *storepb.VirtualMachine {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	return m.updateLocked(mc, fn)
}

// Every change goes through the lifecycle's table: a state change it does
// not allow is a bug, and the record stays as it was (logged and counted).
// Every accepted change is persisted and published as an event.
func (m *Manager) updateLocked(mc *machine, fn func(rec *storepb.VirtualMachine)) *storepb.VirtualMachine {
	prev := proto.Clone(mc.rec).(*storepb.VirtualMachine)
	before := mc.rec.GetState()
	fn(mc.rec)
	after := mc.rec.GetState()
	if err := lifecycle.Check(before, after); err != nil {
		m.illegal.Add(1)
		m.log.Error("vm record change refused", "vm", mc.id, "error", err)
		mc.rec = prev
		return proto.Clone(prev).(*storepb.VirtualMachine)
	}
	if err := m.store.PutVM(mc.rec); err != nil {
		m.log.Error("persist vm record", "vm", mc.id, "error", err)
	}
	if after != before {
		m.log.Info("vm state", "vm", mc.id, "name", mc.rec.GetName(), "from", lifecycle.Name(before), "to", lifecycle.Name(after), "last_error", firstLine(mc.rec.GetLastError()))
	}
	out := proto.Clone(mc.rec).(*storepb.VirtualMachine)
	m.events.Publish(lifecycle.Event{VMID: mc.id, From: before, To: after, Record: out})
	close(mc.changed)
	mc.changed = make(chan struct{})
	return proto.Clone(out).(*storepb.VirtualMachine)
}

// Events are the VMs' record changes, numbered.
func (m *Manager) Events() *lifecycle.Broker { return m.events }

// IllegalTransitions counts the state changes the lifecycle refused (bugs).
func (m *Manager) IllegalTransitions() uint64 { return m.illegal.Load() }

// gone publishes a VM's deletion.
func (m *Manager) gone(id string, last hypervisorv1.State) {
	m.events.Publish(lifecycle.Event{VMID: id, From: last, To: last, Deleted: true})
}

// Update applies fn to a VM's record, persists it and wakes its waiters.
func (m *Manager) Update(id string, fn func(*storepb.VirtualMachine)) error {
	mc, err := m.get(id)
	if err != nil {
		return err
	}
	m.update(mc, fn)
	return nil
}

// Get returns one VM.
func (m *Manager) Get(id string) (*hypervisorv1.VirtualMachine, error) {
	rec, err := m.Record(id)
	return View(rec), err
}

// Guest is the guest-facing side: what the IMDS serves, the guests' reports.
func (m *Manager) Guest() *guestapi.Side { return m.guest }

// Record returns a copy of one VM's stored record.
func (m *Manager) Record(id string) (*storepb.VirtualMachine, error) {
	mc, err := m.get(id)
	if err != nil {
		return nil, err
	}
	rec, _ := mc.snapshot()
	return rec, nil
}

// List returns every VM, oldest first.
func (m *Manager) List() []*hypervisorv1.VirtualMachine {
	recs := m.Records()
	out := make([]*hypervisorv1.VirtualMachine, len(recs))
	for i, r := range recs {
		out[i] = View(r)
	}
	return out
}

// Leased calls fn with the record of the VM holding the lease on ip in
// network, under the record's lock (guestapi.Records).
func (m *Manager) Leased(network string, ip netip.Addr, fn func(*storepb.VirtualMachine)) bool {
	m.mu.Lock()
	mc := m.leases[lease{network, ip.Unmap()}]
	m.mu.Unlock()
	if mc == nil {
		return false
	}
	mc.mu.Lock()
	defer mc.mu.Unlock()
	fn(mc.rec)
	return true
}

// Records returns copies of every stored record, oldest first.
func (m *Manager) Records() []*storepb.VirtualMachine {
	m.mu.Lock()
	mcs := make([]*machine, 0, len(m.machines))
	for _, mc := range m.machines {
		mcs = append(mcs, mc)
	}
	m.mu.Unlock()
	out := make([]*storepb.VirtualMachine, 0, len(mcs))
	for _, mc := range mcs {
		rec, _ := mc.snapshot()
		out = append(out, rec)
	}
	slices.SortFunc(out, func(a, b *storepb.VirtualMachine) int {
		if c := a.GetCreatedAt().AsTime().Compare(b.GetCreatedAt().AsTime()); c != 0 {
			return c
		}
		return compareStrings(a.GetId(), b.GetId())
	})
	return out
}

func compareStrings(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// StoppedOnExit is lastError of a VM powered down by the hypervisor's exit
// with StopVMsOnExit (--detach-vms-on-exit=false).
const StoppedOnExit = "powered down when vm-manager stopped (--detach-vms-on-exit=false); start the VM again"

// Close stops supervising: the VMs keep running for the next hypervisor, or
// with StopVMsOnExit are powered down within the stop timeout.
func (m *Manager) Close() {
	m.mu.Lock()
	m.closing = true
	mcs := make([]*machine, 0, len(m.machines))
	for _, mc := range m.machines {
		mcs = append(mcs, mc)
	}
	m.mu.Unlock()
	if m.cfg.StopVMsOnExit {
		var wg sync.WaitGroup
		for _, mc := range mcs {
			wg.Go(func() {
				mc.mu.Lock()
				if mc.run != nil {
					mc.run.stopReason = StoppedOnExit
				}
				mc.mu.Unlock()
				if _, err := m.Stop(context.Background(), mc.id); err != nil && apierr.CodeOf(err) != apierr.Conflict {
					m.log.Warn("stop on exit", "vm", mc.id, "error", err)
				}
			})
		}
		wg.Wait()
	}
	m.cancel()
	m.wg.Wait()
	for _, mc := range mcs {
		m.closeForwards(mc, true) // bound again by the next hypervisor
	}
	m.nets.Close()
	m.EndWatches()
	if err := m.events.Close(); err != nil {
		m.log.Error("store the watch revision", "error", err)
	}
	for _, mc := range mcs {
		mc.mu.Lock()
		if mc.run != nil {
			m.log.Info("vm left running; the next hypervisor re-adopts it", "vm", mc.id, "pid", mc.run.proc.Processes().GetQemu().GetPid())
		}
		mc.mu.Unlock()
	}
}

func firstLine(s string) string {
	for i, r := range s {
		if r == '\n' {
			return s[:i]
		}
	}
	return s
}
