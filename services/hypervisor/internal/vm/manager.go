// Package vm is the VM lifecycle: records in bbolt, swtpm and QEMU processes
// that outlive the hypervisor, readiness, stop/start/reboot/delete, and the
// re-adoption of running VMs after a hypervisor restart (contract §3).
//
// Locking: each VM has an operation mutex (op) serialising create, start,
// stop, reboot and delete, and a record mutex (mu) guarding the record and
// its runtime. Every transition is persisted and wakes all waiters.
package vm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/giantswarm/vm-manager/gen/apierr"
	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/forward"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/guest"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/lifecycle"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/network"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/notify"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/sshexec"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/store/storepb"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
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
	// (--metrics-guest-series-limit; guest.DefaultGuestSeriesLimit when 0).
	GuestSeriesLimit int
	// StopVMsOnExit powers VMs down when the hypervisor stops (a pod, whose
	// end kills its children anyway). By default they keep running for the
	// next hypervisor to re-adopt.
	StopVMsOnExit bool
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
	nets     *network.Registry
	events   *lifecycle.Broker
	illegal  atomic.Uint64
	guest    *guest.Side
	closing  bool
	wg       sync.WaitGroup
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
}

// New loads the records and re-adopts the VMs whose processes still run.
func New(cfg Config, log *slog.Logger, st Store, images ImageResolver, verifier attestationv1.VerifierServiceClient, router *notify.Router, driver Driver) (*Manager, error) {
	cfg.defaults()
	ctx, cancel := context.WithCancel(context.Background())
	m := &Manager{cfg: cfg, log: log, store: st, images: images, verifier: verifier, router: router, driver: driver, ctx: ctx, cancel: cancel,
		machines: map[string]*machine{}, newID: newID, events: lifecycle.NewBroker(0)}
	m.guest = guest.New(m, verifier, guest.Config{ImageDir: cfg.ImageDir, SeriesLimit: cfg.GuestSeriesLimit}, log)
	m.nets = network.NewRegistry(ctx, st, func(name string) http.Handler {
		return imds.New(m.guest.Network(name), log.With("network", name))
	}, log)
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
		mc := &machine{id: rec.GetId(), rec: rec, changed: make(chan struct{})}
		m.machines[mc.id] = mc
		m.restore(mc, strays[mc.id])
		m.restoreForwards(mc)
		delete(strays, mc.id)
	}
	for id, procs := range strays { // of VM directories without a record
		m.endStrays(id, procs, nil)
	}
	m.sweepDeleted()
	m.wg.Go(m.forgetLoop)
	return m, nil
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

//
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
func (m *Manager) Guest() *guest.Side { return m.guest }

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

func newID() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// freeIDLocked picks an id no VM has, no deleted VM's forget still waits on
// (attestation would forget the new VM's pin with the old one's) and no
// directory left in place uses. Called with m.mu held.
func (m *Manager) freeIDLocked() string {
	pending, err := m.store.PendingForgets()
	if err != nil {
		m.log.Warn("list vms attestation has to forget", "error", err)
	}
	for {
		id := m.newID()
		if m.machines[id] != nil || slices.Contains(pending, id) {
			continue
		}
		if _, err := os.Lstat(m.vmDir(id)); err == nil {
			continue
		}
		return id
	}
}

// Create validates, allocates and boots a VM, then waits per wait_for.
func (m *Manager) Create(ctx context.Context, req *hypervisorv1.CreateVirtualMachineRequest, createdBy string) (*hypervisorv1.VirtualMachine, error) {
	r, err := validate(req, m.images)
	if err != nil {
		return nil, err
	}
	m.mu.Lock()
	if m.closing {
		m.mu.Unlock()
		return nil, apierr.Errorf(apierr.Conflict, "vm-manager is shutting down")
	}
	for _, other := range m.machines {
		other.mu.Lock()
		name, id := other.rec.GetName(), other.id
		other.mu.Unlock()
		if name == r.name {
			m.mu.Unlock()
			return nil, apierr.Errorf(apierr.Conflict, "vm name %q is in use by %s", r.name, id)
		}
	}
	id := m.freeIDLocked()
	netName := req.GetNetwork()
	if netName == "" {
		netName = m.cfg.DefaultNetwork
	}
	machineID := make([]byte, 16)
	_, _ = rand.Read(machineID)
	dir := m.vmDir(id)
	rec := &storepb.VirtualMachine{
		Id:                 id,
		Name:               r.name,
		Image:              r.image.GetRef(),
		KubernetesVersion:  r.kubernetesVersion,
		Cpus:               r.cpus,
		MemoryMib:          r.memoryMiB,
		DiskGib:            r.diskGiB,
		SshAuthorizedKeys:  r.sshKeys,
		Hostname:           r.hostname,
		Metadata:           r.metadata,
		Region:             m.cfg.Region,
		RequireAttestation: r.requireAttestation,
		State:              hypervisorv1.State_STATE_CREATING,
		MachineId:          hex.EncodeToString(machineID),
		Accelerator:        m.cfg.Accelerator,
		CreatedAt:          timestamppb.Now(),
		CreatedBy:          createdBy,
		Paths: &hypervisorv1.Paths{
			Dir:          dir,
			Console:      filepath.Join(dir, "console.log"),
			TpmState:     filepath.Join(dir, "tpm"),
			OvmfVars:     filepath.Join(dir, "ovmf_vars.fd"),
			QmpSocket:    filepath.Join(dir, "qmp.sock"),
			QemuLog:      filepath.Join(dir, "qemu.log"),
			NotifySocket: filepath.Join(dir, "notify.sock"),
			NetSocket:    filepath.Join(dir, "net.sock"),
			SshKey:       filepath.Join(dir, "ssh_key"),
			SshHostKey:   filepath.Join(dir, "ssh_host_key"),
		},
	}
	sshKey, err := newSSHKey(rec)
	if err != nil {
		m.mu.Unlock()
		return nil, apierr.Errorf(apierr.Internal, "per-VM SSH key: %v", err)
	}
	if r.userData != "" {
		rec.Paths.UserData = filepath.Join(dir, "user-data")
	}
	if r.image.GetKind() == hypervisorv1.ImageKind_IMAGE_KIND_UKI {
		rec.Paths.Volume = filepath.Join(dir, "disk.raw")
	}
	mc := &machine{id: id, rec: rec, changed: make(chan struct{})}
	mc.op.Lock()
	m.machines[id] = mc
	m.mu.Unlock()
	if netName != "" {
		ip, mac, err := m.nets.Attach(netName, id)
		if err != nil {
			m.discard(mc)
			mc.op.Unlock()
			return nil, err
		}
		rec.Network, rec.Ip, rec.Mac, rec.Zone = netName, ip.String(), mac, netName
	}

	// The directory, marked, before the record: a restart in between sweeps it.
	if err := m.makeDir(id); err != nil {
		m.discard(mc)
		mc.op.Unlock()
		return nil, apierr.Errorf(apierr.Internal, "vm directory: %v", err)
	}
	if err := m.store.PutVM(rec); err != nil {
		m.discard(mc)
		mc.op.Unlock()
		return nil, err
	}
	m.events.Publish(lifecycle.Event{VMID: id, To: hypervisorv1.State_STATE_CREATING, Record: proto.Clone(rec).(*storepb.VirtualMachine)})
	m.unmark(id)
	err = m.prepare(rec, r, sshKey)
	if err == nil {
		phase := hypervisorv1.Phase_PHASE_BOOT
		if r.image.GetKind() == hypervisorv1.ImageKind_IMAGE_KIND_UKI {
			phase = hypervisorv1.Phase_PHASE_INSTALL
		}
		err = m.launch(mc, phase)
	}
	mc.op.Unlock()
	if err != nil {
		// Nothing ran: the contract discards a VM whose first boot did not start.
		m.discard(mc)
		return nil, apierr.Errorf(apierr.VMFailed, "vm %s could not start: %v", id, err)
	}
	rec, err = m.wait(ctx, mc, r.waitFor, m.deadline(r.waitFor))
	return View(rec), err
}

// prepare writes the VM's directory: SSH key, user-data, and what the driver
// needs (firmware variables, disk).
func (m *Manager) prepare(rec *storepb.VirtualMachine, r *request, sshKey []byte) error {
	p := rec.GetPaths()
	if err := os.Chmod(p.GetDir(), 0o700); err != nil {
		return err
	}
	if err := sshexec.WriteKey(p.GetSshKey(), sshKey); err != nil {
		return fmt.Errorf("per-VM SSH key: %w", err)
	}
	if p.GetUserData() != "" {
		if err := os.WriteFile(p.GetUserData(), []byte(r.userData), 0o600); err != nil {
			return err
		}
	}
	return m.driver.Prepare(rec)
}

// discard drops a VM that never ran.
func (m *Manager) discard(mc *machine) {
	if err := m.drop(mc); err != nil {
		m.log.Error("discard vm", "vm", mc.id, "error", err)
	}
}

// drop removes a VM: its record first, then its lease and files (a restart
// in between finds a lease or a marked directory without a record and
// removes them: sweepDeleted; never a record without its lease or files).
// Waiters wake, and the deletion is published. A record that cannot be
// deleted leaves everything in place.
func (m *Manager) drop(mc *machine) error {
	if err := m.markDeleted(mc.id); err != nil {
		return apierr.Errorf(apierr.Internal, "delete vm %s: %v", mc.id, err)
	}
	if err := m.store.DeleteVM(mc.id); err != nil {
		m.unmark(mc.id)
		return err
	}
	m.mu.Lock()
	delete(m.machines, mc.id)
	m.mu.Unlock()
	if n := mc.rec.GetNetwork(); n != "" {
		m.nets.Detach(n, mc.id)
	}
	m.removeDir(mc.id)
	mc.mu.Lock()
	last := mc.rec.GetState()
	close(mc.changed)
	mc.changed = make(chan struct{})
	mc.mu.Unlock()
	m.gone(mc.id, last)
	return nil
}

func (m *Manager) deadline(w hypervisorv1.WaitFor) time.Duration {
	switch w {
	case hypervisorv1.WaitFor_WAIT_FOR_NONE:
		return 0
	case hypervisorv1.WaitFor_WAIT_FOR_INSTALLED:
		return m.cfg.InstallTimeout + m.cfg.StopTimeout
	default:
		return m.cfg.InstallTimeout + m.cfg.StopTimeout + m.cfg.BootTimeout
	}
}

func reached(rec *storepb.VirtualMachine, w hypervisorv1.WaitFor) bool {
	switch w {
	case hypervisorv1.WaitFor_WAIT_FOR_NONE:
		return true
	case hypervisorv1.WaitFor_WAIT_FOR_INSTALLED:
		return rec.GetInstalledAt() != nil
	case hypervisorv1.WaitFor_WAIT_FOR_ATTESTED:
		return rec.GetBootedAt() != nil && rec.GetAttestation().GetUserDataReleased()
	default:
		return rec.GetReadyAt() != nil
	}
}

// wait blocks until the VM reaches w, fails, or the deadline passes; the VM
// keeps running in every case.
func (m *Manager) wait(ctx context.Context, mc *machine, w hypervisorv1.WaitFor, d time.Duration) (*storepb.VirtualMachine, error) {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		rec, changed := mc.snapshot()
		if reached(rec, w) {
			return rec, nil
		}
		switch s := rec.GetState(); s {
		case hypervisorv1.State_STATE_FAILED:
			return nil, failedErr(rec, fmt.Sprintf("vm %s failed before %s", rec.GetId(), waitName(w)))
		case hypervisorv1.State_STATE_STOPPING, hypervisorv1.State_STATE_STOPPED, hypervisorv1.State_STATE_DELETING:
			return nil, failedErr(rec, fmt.Sprintf("vm is %s", lifecycle.Name(s)))
		}
		select {
		case <-changed:
		case <-timer.C:
			return nil, apierr.Errorf(apierr.Timeout, "vm %s did not reach %s within %s (state %s)", rec.GetId(), waitName(w), fmtDuration(d), lifecycle.Name(rec.GetState()))
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// failedErr is the contract's message for a create that did not reach its milestone.
func failedErr(rec *storepb.VirtualMachine, cause string) error {
	state := lifecycle.Name(rec.GetState())
	if le := rec.GetLastError(); le != "" {
		state += ": " + le
	}
	return apierr.Errorf(apierr.VMFailed, "%s; vm %s is %s (follow it with get_vm %s, delete it with delete_vm)", cause, rec.GetId(), state, rec.GetId())
}

func isLive(s hypervisorv1.State) bool {
	switch s {
	case hypervisorv1.State_STATE_INSTALLING, hypervisorv1.State_STATE_BOOTING, hypervisorv1.State_STATE_ATTESTING,
		hypervisorv1.State_STATE_READY, hypervisorv1.State_STATE_RUNNING, hypervisorv1.State_STATE_STOPPING:
		return true
	}
	return false
}

// Start boots a stopped or failed VM from its disk (phase boot).
func (m *Manager) Start(ctx context.Context, id string) (*hypervisorv1.VirtualMachine, error) {
	mc, err := m.get(id)
	if err != nil {
		return nil, err
	}
	mc.op.Lock()
	defer mc.op.Unlock()
	if err := m.startLocked(mc); err != nil {
		return nil, err
	}
	rec, _ := mc.snapshot()
	return View(rec), nil
}

func (m *Manager) startLocked(mc *machine) error {
	m.mu.Lock()
	closing := m.closing
	m.mu.Unlock()
	if closing {
		return apierr.Errorf(apierr.Conflict, "vm-manager is shutting down")
	}
	rec, _ := mc.snapshot()
	switch rec.GetState() {
	case hypervisorv1.State_STATE_STOPPED, hypervisorv1.State_STATE_FAILED:
	default:
		return apierr.Errorf(apierr.Conflict, "vm %s is %s; only a stopped or failed vm can be started", mc.id, lifecycle.Name(rec.GetState()))
	}
	img, err := m.images.Get(rec.GetImage())
	if err != nil {
		return apierr.Errorf(apierr.Conflict, "vm %s: its image %s is no longer in the catalog", mc.id, rec.GetImage())
	}
	if img.GetKind() == hypervisorv1.ImageKind_IMAGE_KIND_UKI && rec.GetInstalledAt() == nil {
		return apierr.Errorf(apierr.Conflict, "vm %s was never installed; delete it and create it again", mc.id)
	}
	mc.mu.Lock()
	mc.resets = nil // a boot loop's count starts again with the caller's start
	mc.mu.Unlock()
	if err := m.launch(mc, hypervisorv1.Phase_PHASE_BOOT); err != nil {
		return apierr.Errorf(apierr.VMFailed, "vm %s could not start: %v", mc.id, err)
	}
	return nil
}

// Stop powers the VM down (ACPI, then SIGTERM, then SIGKILL) and returns the
// settled record. The caller going away does not cut the stop short.
func (m *Manager) Stop(_ context.Context, id string) (*hypervisorv1.VirtualMachine, error) {
	mc, err := m.get(id)
	if err != nil {
		return nil, err
	}
	mc.op.Lock()
	defer mc.op.Unlock()
	if err := m.stopLocked(mc); err != nil {
		return nil, err
	}
	rec, _ := mc.snapshot()
	return View(rec), nil
}

func (m *Manager) stopLocked(mc *machine) error {
	mc.mu.Lock()
	rt, state := mc.run, mc.rec.GetState()
	if state == hypervisorv1.State_STATE_DELETING {
		mc.mu.Unlock()
		return apierr.Errorf(apierr.Conflict, "vm %s is being deleted", mc.id)
	}
	if rt == nil && state == hypervisorv1.State_STATE_BOOTING {
		// Between a guest reset and its next boot: that boot will not start.
		m.updateLocked(mc, func(rec *storepb.VirtualMachine) { rec.State = hypervisorv1.State_STATE_STOPPED })
		mc.mu.Unlock()
		return nil
	}
	if rt == nil || !isLive(state) {
		mc.mu.Unlock()
		return apierr.Errorf(apierr.Conflict, "vm %s is not running (state %s)", mc.id, lifecycle.Name(state))
	}
	rt.stopping.Store(true)
	m.updateLocked(mc, func(rec *storepb.VirtualMachine) { rec.State = hypervisorv1.State_STATE_STOPPING })
	mc.mu.Unlock()
	m.powerOff(mc, rt)
	return nil
}

// powerOff asks the guest to power down, escalates after the stop timeout and
// waits until the supervisor has settled the record.
func (m *Manager) powerOff(mc *machine, rt *runtime) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	if err := rt.proc.PowerDown(ctx); err != nil {
		m.log.Warn("power-down failed", "vm", mc.id, "error", err)
	}
	cancel()
	select {
	case <-rt.proc.Done():
	case <-time.After(m.cfg.StopTimeout):
		m.log.Warn("guest did not power off within the stop timeout; terminating it", "vm", mc.id, "timeout", m.cfg.StopTimeout)
		rt.proc.Terminate(m.cfg.KillGrace)
	}
	<-rt.settled
}

// Reboot is Stop followed by Start.
func (m *Manager) Reboot(_ context.Context, id string) (*hypervisorv1.VirtualMachine, error) {
	mc, err := m.get(id)
	if err != nil {
		return nil, err
	}
	mc.op.Lock()
	defer mc.op.Unlock()
	rec, _ := mc.snapshot()
	if isLive(rec.GetState()) {
		if err := m.stopLocked(mc); err != nil {
			return nil, err
		}
	}
	if err := m.startLocked(mc); err != nil {
		return nil, err
	}
	rec, _ = mc.snapshot()
	return View(rec), nil
}

// Delete stops the VM and removes its files and record. Not undoable.
func (m *Manager) Delete(_ context.Context, id string) error {
	mc, err := m.get(id)
	if err != nil {
		return err
	}
	mc.mu.Lock()
	if mc.rec.GetState() == hypervisorv1.State_STATE_DELETING && mc.run != nil {
		mc.mu.Unlock()
		return apierr.Errorf(apierr.Conflict, "vm %s is already being deleted", id)
	}
	mc.mu.Unlock()
	mc.op.Lock()
	defer mc.op.Unlock()
	if _, err := m.get(id); err != nil {
		return err // deleted while we waited for the op lock
	}
	mc.mu.Lock()
	rt := mc.run
	if rt != nil {
		rt.stopping.Store(true)
	}
	m.updateLocked(mc, func(rec *storepb.VirtualMachine) { rec.State = hypervisorv1.State_STATE_DELETING })
	mc.mu.Unlock()
	if rt != nil {
		m.powerOff(mc, rt)
	}
	m.closeForwards(mc, false)
	if err := m.drop(mc); err != nil {
		return err
	}
	if m.verifier != nil {
		if err := m.forget(id); err != nil {
			m.log.Warn("attestation could not forget the vm yet; retrying in the background", "vm", id, "error", err)
		}
	}
	m.log.Info("vm deleted", "vm", id)
	return nil
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
