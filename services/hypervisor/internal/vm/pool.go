package vm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/lifecycle"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// This file is the VM side of warm pools (internal/pool keeps the pools):
// a member is a VM record with pool set, booted without an identity of its
// own, whose guest waits for its user-data after a verified initrd quote
// and is then suspended. A create of the member's shape claims it: one
// persisted write gives it the caller's name, hostname, keys, metadata,
// user-data, lifetime and createdBy and clears pool, then it is resumed and
// the guest's next user-data poll gets the claimer's. The boot, its vTPM
// and its attestation verdict stay the member's own: the gate is not
// reopened for the claim, and a member whose initrd quote did not verify is
// never parked.

// Pools are the warm pools, as creates see them (internal/pool).
type Pools interface {
	// Match names the pool whose shape is s.
	Match(s *hypervisorv1.PoolShape) (string, bool)
	// Counted records a create of the pool's shape: a hit when it claimed a
	// member, a miss when it booted cold (the pool then refills).
	Counted(pool string, hit bool)
}

// memberName is an unclaimed member's name.
func memberName(pool, id string) string { return "pool." + pool + "." + id }

// shapeOf is the shape of a validated create.
func shapeOf(r *request, network string) *hypervisorv1.PoolShape {
	return &hypervisorv1.PoolShape{
		Image: r.image.GetRef(), KubernetesVersion: r.kubernetesVersion, Cpus: r.cpus, MemoryMib: r.memoryMiB,
		DiskGib: r.diskGiB, Network: network, RequireAttestation: r.requireAttestation,
	}
}

// recordShape is the shape a record was made with.
func recordShape(rec *storepb.VirtualMachine) *hypervisorv1.PoolShape {
	return &hypervisorv1.PoolShape{
		Image: rec.GetImage(), KubernetesVersion: rec.GetKubernetesVersion(), Cpus: rec.GetCpus(), MemoryMib: rec.GetMemoryMib(),
		DiskGib: rec.GetDiskGib(), Network: rec.GetNetwork(), RequireAttestation: rec.GetRequireAttestation(),
	}
}

// PoolShape validates a pool's shape as a create of it would be, with the
// same defaults and bounds.
func (m *Manager) PoolShape(req *hypervisorv1.CreatePoolRequest) (*hypervisorv1.PoolShape, error) {
	r, err := validate(&hypervisorv1.CreateVirtualMachineRequest{
		Name: "pool-shape", Image: req.GetImage(), KubernetesVersion: req.GetKubernetesVersion(),
		Cpus: req.Cpus, MemoryMib: req.MemoryMib, DiskGib: req.DiskGib, RequireAttestation: req.RequireAttestation,
	}, m.images, m.cfg.Limits)
	if err != nil {
		return nil, err
	}
	network := req.GetNetwork()
	if network == "" {
		network = m.cfg.DefaultNetwork
	}
	if network != "" {
		if _, err := m.nets.Get(network); err != nil {
			return nil, apierr.Invalidf("network", "unknown network %q", network)
		}
	}
	return shapeOf(r, network), nil
}

// CreateMember boots a member of pool: no user-data, no lifetime, hidden
// from lists and watches. It returns once QEMU runs.
func (m *Manager) CreateMember(ctx context.Context, pool string, shape *hypervisorv1.PoolShape) (string, error) {
	req := &hypervisorv1.CreateVirtualMachineRequest{
		Name: "member", Image: shape.GetImage(), KubernetesVersion: shape.GetKubernetesVersion(),
		Cpus: proto.Int32(shape.GetCpus()), MemoryMib: proto.Int32(shape.GetMemoryMib()), DiskGib: proto.Int32(shape.GetDiskGib()),
		RequireAttestation: proto.Bool(shape.GetRequireAttestation()), WaitFor: hypervisorv1.WaitFor_WAIT_FOR_NONE,
	}
	r, err := validate(req, m.images, m.cfg.Limits)
	if err != nil {
		return "", err
	}
	vm, err := m.create(ctx, r, shape.GetNetwork(), nil, "pool:"+pool, pool)
	if err != nil {
		return "", err
	}
	return vm.GetId(), nil
}

// Member is an unclaimed member as its pool sees it.
type Member struct {
	ID, Pool string
	State    hypervisorv1.State
	// Dir is the member's directory (its disk use is the pool's).
	Dir string
}

// Members are pool's unclaimed members ("": every pool's), oldest first.
func (m *Manager) Members(pool string) []Member {
	var out []Member
	for _, rec := range m.table.Records() {
		if isMember(rec) && (pool == "" || rec.GetPool() == pool) {
			out = append(out, Member{ID: rec.GetId(), Pool: rec.GetPool(), State: rec.GetState(), Dir: rec.GetPaths().GetDir()})
		}
	}
	return out
}

// PoolMemberWaiting says whether vmID is an unclaimed member, and records
// that its guest asked for its user-data (the IMDS's answer is then 503
// until a claim): the member can be parked.
func (tb *Table) PoolMemberWaiting(vmID string) bool {
	mc, err := tb.get(vmID)
	if err != nil {
		return false
	}
	mc.mu.Lock()
	defer mc.mu.Unlock()
	if mc.rec.GetPool() == "" {
		return false
	}
	if !mc.waiting {
		mc.waiting = true
		close(mc.changed) // wakes WaitParked; the record is unchanged
		mc.changed = make(chan struct{})
	}
	return true
}

// WaitParked waits until member id's guest waits for its user-data after
// its initrd quote verified. A member whose quote was rejected, or that
// stopped or failed, is an error: it will not become ready.
func (m *Manager) WaitParked(ctx context.Context, id string) error {
	mc, err := m.table.get(id)
	if err != nil {
		return err
	}
	for {
		mc.mu.Lock()
		rec, waiting, changed := mc.rec, mc.waiting, mc.changed
		verdict := initrdVerdict(rec)
		state := rec.GetState()
		mc.mu.Unlock()
		switch {
		case verdict == verdictRejected:
			return fmt.Errorf("member %s: its initrd quote was rejected: %s", id, firstLine(rec.GetLastError()))
		case !isLive(state) || state == hypervisorv1.State_STATE_STOPPING:
			return fmt.Errorf("member %s is %s before it was ready to park: %s", id, lifecycle.Name(state), firstLine(rec.GetLastError()))
		case waiting && verdict == verdictVerified:
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("member %s: not waiting for its user-data with a verified initrd quote: %w", id, ctx.Err())
		}
	}
}

type verdict int

const (
	verdictPending verdict = iota
	verdictVerified
	verdictRejected
)

// initrdVerdict is the current boot's initrd stage as attestation decided
// it (the record's cached answer).
func initrdVerdict(rec *storepb.VirtualMachine) verdict {
	q := rec.GetAttestation().GetInitrd()
	switch {
	case q == nil:
		return verdictPending
	case q.GetVerified():
		return verdictVerified
	}
	return verdictRejected
}

// Park suspends a member that WaitParked said is waiting.
func (m *Manager) Park(_ context.Context, id string) error {
	_, err := m.lockedSuspender(id, func(s Suspender, mc *machine) error {
		if rec, _ := mc.snapshot(); rec.GetPool() == "" {
			return apierr.Errorf(apierr.Conflict, "vm %s is not a pool member (claimed meanwhile)", id)
		}
		return m.suspendLocked(s, mc)
	})
	return err
}

// claim hands a ready member of pool to the caller: claimed is false when
// none was ready (or its resume failed, which discards it): the caller then
// boots cold. A member is claimed once: it is chosen under the table's lock
// and marked, and the claim is one persisted write, so a kill leaves it
// either a member or the caller's.
func (m *Manager) claim(ctx context.Context, pool string, r *request, netName string, lifetime *hypervisorv1.Lifetime, createdBy string) (*hypervisorv1.VirtualMachine, bool, error) {
	want := shapeOf(r, netName)
	m.table.mu.Lock()
	if m.table.closing {
		m.table.mu.Unlock()
		return nil, false, apierr.Errorf(apierr.Conflict, "vm-manager is shutting down")
	}
	var pick *machine
	for _, mc := range m.table.machines {
		mc.mu.Lock()
		rec := mc.rec
		if rec.GetName() == r.name {
			mc.mu.Unlock()
			m.table.mu.Unlock()
			return nil, false, apierr.Errorf(apierr.Conflict, "vm name %q is in use by %s", r.name, mc.id)
		}
		ok := pick == nil && !mc.claiming && rec.GetPool() == pool && rec.GetState() == hypervisorv1.State_STATE_SUSPENDED &&
			proto.Equal(recordShape(rec), want)
		mc.mu.Unlock()
		if ok {
			pick = mc
		}
	}
	if pick == nil {
		m.table.mu.Unlock()
		return nil, false, nil
	}
	pick.claiming = true
	m.table.mu.Unlock()
	if afterPick != nil {
		afterPick()
	}
	defer func() {
		m.table.mu.Lock()
		pick.claiming = false
		m.table.mu.Unlock()
	}()

	start := time.Now()
	pick.op.Lock()
	err := m.claimLocked(pick, pool, r, lifetime, createdBy)
	if err == nil {
		err = m.resumeClaimed(pick)
	}
	pick.op.Unlock()
	if errors.Is(err, errNotClaimable) {
		return nil, false, nil // deleted or changed meanwhile: a miss
	}
	if err != nil {
		m.log.Warn("a claimed pool member did not resume; it is discarded and the create boots cold", "vm", pick.id, "pool", pool, "error", err)
		if derr := m.Delete(context.Background(), pick.id); derr != nil {
			m.log.Error("discard the claimed member", "vm", pick.id, "error", derr)
			return nil, false, apierr.Errorf(apierr.VMFailed, "vm %s, claimed from pool %s, did not resume and could not be discarded: %v", pick.id, pool, err)
		}
		return nil, false, nil
	}
	m.log.Info("vm claimed from a pool", "vm", pick.id, "pool", pool, "name", r.name, "seconds", time.Since(start).Seconds())
	rec, err := m.wait(ctx, pick, r.waitFor, m.deadline(r.waitFor))
	return View(rec), true, err
}

var errNotClaimable = errors.New("the member is no longer claimable")

// afterPick, set by tests only, runs between a claim's choice of a member
// and its write: the window two claims of one member would race in.
var afterPick func()

// claimLocked writes the caller's identity into the member, under its op
// lock: the user-data file first (a kill after it leaves a member whose
// user-data answer is still 503, and the next claim writes it again), then
// the record, persisted before it is published.
func (m *Manager) claimLocked(mc *machine, pool string, r *request, lifetime *hypervisorv1.Lifetime, createdBy string) error {
	if cur, err := m.table.get(mc.id); err != nil || cur != mc {
		return errNotClaimable
	}
	rec, _ := mc.snapshot()
	if rec.GetPool() != pool || rec.GetState() != hypervisorv1.State_STATE_SUSPENDED {
		return errNotClaimable
	}
	userData := ""
	if r.userData != "" {
		userData = filepath.Join(rec.GetPaths().GetDir(), "user-data")
		if err := os.WriteFile(userData, []byte(r.userData), 0o600); err != nil {
			return fmt.Errorf("user-data: %w", err)
		}
	}
	apply := func(x *storepb.VirtualMachine) {
		x.Pool, x.FromPool, x.ClaimedAt = "", pool, timestamppb.Now()
		x.Name, x.Hostname = r.name, r.hostname
		x.SshAuthorizedKeys, x.Metadata = r.sshKeys, r.metadata
		x.Lifetime, x.CreatedBy = lifetime, createdBy
		x.Paths.UserData = userData
	}
	mc.mu.Lock()
	defer mc.mu.Unlock()
	next := proto.Clone(mc.rec).(*storepb.VirtualMachine)
	apply(next)
	// Persisted first: the claim holds once this write did, and not before.
	if err := m.store.PutVM(next); err != nil {
		return fmt.Errorf("%w: %v", errNotClaimable, err)
	}
	m.table.updateLocked(mc, apply)
	return nil
}

// resumeClaimed resumes a claimed member, under its op lock.
func (m *Manager) resumeClaimed(mc *machine) error {
	s, err := m.runner.suspender()
	if err != nil {
		return err
	}
	return m.resumeLocked(s, mc)
}

// resumeClaims resumes the VMs claimed before a restart that were not
// resumed since (suspended before their claim): the claimer is owed a
// running VM.
func (m *Manager) resumeClaims() {
	for _, rec := range m.table.Records() {
		if rec.GetFromPool() == "" || rec.GetState() != hypervisorv1.State_STATE_SUSPENDED ||
			!rec.GetSuspendedAt().AsTime().Before(rec.GetClaimedAt().AsTime()) {
			continue
		}
		m.log.Info("resuming a VM claimed before the restart", "vm", rec.GetId(), "pool", rec.GetFromPool())
		if _, err := m.Resume(m.ctx, rec.GetId()); err != nil {
			m.log.Warn("resume a claimed VM", "vm", rec.GetId(), "error", err)
		}
	}
}

// isMember says whether a record is an unclaimed member (hidden).
func isMember(rec *storepb.VirtualMachine) bool { return rec.GetPool() != "" }
