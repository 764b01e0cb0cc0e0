// Package vm is the VM lifecycle (contract §3), in parts that each hold one
// responsibility and are wired together in server/:
//
//   - Table: the stored records and the lifecycle table every change passes;
//   - Runner: a VM's runs over a Driver (launch, supervise, re-adopt) and
//     every boot's registration with attestation (Boots);
//   - Manager: the verbs (create, start, stop, reboot, suspend, resume,
//     delete), waits, lifetimes carried out, forgets;
//   - Activity: touches, holds and idle clocks, what a lifetime makes due;
//   - Access: exec, forwards and metrics, through the VM's network;
//   - Watches: the watch streams, fed by the Table's events;
//   - Consoles: console reads and rotation;
//   - Bounds: the counters of every bound.
//
// The networks are network.Registry's, what guests reach guestapi's; the
// legal state changes are the lifecycle package's.
//
// Locking: each VM has an operation mutex (op) serialising create, start,
// stop, reboot and delete, and a record mutex (mu) guarding the record and
// its runtime. Every change is checked, persisted, published and wakes all
// waiters (updateLocked).
package vm

import (
	"context"
	"log/slog"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/forward"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/network"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"go.opentelemetry.io/otel/trace"
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

// WithDefaults is c with every zero field that has a default set to it: what
// the parts work with, and what the caller wiring them should use too.
func (c Config) WithDefaults() Config {
	c.defaults()
	return c
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

// Manager is the VM lifecycle's verbs: create, start, stop, reboot,
// suspend, resume, delete, and what lifetimes make due. The runs are the
// Runner's, the records the Table's.
type Manager struct {
	cfg      Config
	log      *slog.Logger
	store    Store
	images   ImageResolver
	verifier attestationv1.VerifierServiceClient
	driver   Driver

	table    *Table
	runner   *Runner
	activity *Activity
	access   *Access
	nets     *network.Registry
	imds     *imds.Guard

	ctx    context.Context // ends when the hypervisor stops
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// startOnce guards RunLoops: the loops run once.
	startOnce sync.Once

	refused *Refusals
	pools   Pools // nil: no warm pools
	// suspends counts suspends and resumes (suspend.go).
	suspends suspendStats
}

// Deps are what a Manager works with, built by the caller (server/).
type Deps struct {
	Store    Store
	Images   ImageResolver
	Verifier attestationv1.VerifierServiceClient // nil: no attestation service
	Driver   Driver
	Table    *Table
	Runner   *Runner
	Activity *Activity
	Access   *Access
	Networks *network.Registry
	IMDS     *imds.Guard
	Refusals *Refusals
	Pools    Pools // nil: no warm pools
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
	// Warm pools (pool.go): the member's guest asked for its user-data
	// (under mu); a claim chose it (under the table's mu).
	waiting, claiming bool
	console           consoleCounters
	trace             trace.SpanContext // the call that started the current boot (trace.go)

	// Lifetimes (lifetime.go, expire.go): the last touch and the last
	// persisted one (unix seconds), open exec sessions, an action running.
	touched, persisted atomic.Int64
	holds              atomic.Int32
	acting             atomic.Bool
}

// New re-adopts the VMs of the Table's records whose processes still run and
// settles the others. The networks must be restored first: re-adopted VMs
// redial their network's socket. It starts no loop (RunLoops does).
func New(cfg Config, log *slog.Logger, d Deps) *Manager {
	cfg.defaults()
	ctx, cancel := context.WithCancel(context.Background())
	m := &Manager{cfg: cfg, log: log, store: d.Store, images: d.Images, verifier: d.Verifier, driver: d.Driver,
		table: d.Table, runner: d.Runner, activity: d.Activity, access: d.Access, nets: d.Networks, imds: d.IMDS,
		refused: d.Refusals, pools: d.Pools, ctx: ctx, cancel: cancel}
	strays := m.driver.Strays()
	for _, mc := range m.table.all() {
		m.runner.restore(mc, strays[mc.id])
		m.activity.restartIdleClock(mc)
		m.access.restoreForwards(mc)
		delete(strays, mc.id)
	}
	for id, procs := range strays { // of VM directories without a record
		m.runner.endStrays(id, procs, nil)
	}
	m.sweepDeleted()
	return m
}

// RunLoops runs the background loops: forgetting deleted records, carrying
// out lifetimes. New starts none of them, so that what configures a Manager
// (the server, a test) is done before anything reads it concurrently. Later
// calls do nothing.
func (m *Manager) RunLoops() {
	m.startOnce.Do(func() {
		m.wg.Go(m.forgetLoop)
		m.wg.Go(m.lifetimeLoop)
		m.wg.Go(m.resumeClaims)
		m.wg.Go(m.resendForkMessages)
	})
}

// StoppedOnExit is lastError of a VM powered down by the hypervisor's exit
// with StopVMsOnExit (--detach-vms-on-exit=false).
const StoppedOnExit = "powered down when vm-manager stopped (--detach-vms-on-exit=false); start the VM again"

// Close stops supervising: the VMs keep running for the next hypervisor, or
// with StopVMsOnExit are powered down within the stop timeout. The networks,
// the watches and the Table are closed after it, by their owner.
func (m *Manager) Close() {
	m.table.mu.Lock()
	m.table.closing = true
	mcs := make([]*machine, 0, len(m.table.machines))
	for _, mc := range m.table.machines {
		mcs = append(mcs, mc)
	}
	m.table.mu.Unlock()
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
	m.runner.detach()
	for _, mc := range mcs {
		m.access.closeForwards(mc, true) // bound again by the next hypervisor
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
