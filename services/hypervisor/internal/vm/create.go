package vm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/lifecycle"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/sshexec"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
)

func newID() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// freeIDLocked picks an id no VM has, no deleted VM's forget still waits on
// (attestation would forget the new VM's pin with the old one's) and no
// directory left in place uses. Called with m.mu held.
func (tb *Table) freeIDLocked() string {
	pending, err := tb.store.PendingForgets()
	if err != nil {
		tb.log.Warn("list vms attestation has to forget", "error", err)
	}
	for {
		id := tb.newID()
		if tb.machines[id] != nil || slices.Contains(pending, id) {
			continue
		}
		if _, err := os.Lstat(tb.vmDir(id)); err == nil {
			continue
		}
		return id
	}
}

// PathsIn are the files of a VM whose directory is dir (contract §3.7).
func PathsIn(dir string) *hypervisorv1.Paths {
	return &hypervisorv1.Paths{
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
	}
}

// Create validates, allocates and boots a VM, then waits per wait_for.
func (m *Manager) Create(ctx context.Context, req *hypervisorv1.CreateVirtualMachineRequest, createdBy string) (*hypervisorv1.VirtualMachine, error) {
	r, err := validate(req, m.images, m.cfg.Limits)
	if err != nil {
		return nil, err
	}
	lifetime, err := m.cfg.Lifetimes.createLifetime(req, time.Now())
	if err != nil {
		return nil, err
	}
	netName := req.GetNetwork()
	if netName == "" {
		netName = m.cfg.DefaultNetwork
	}
	if m.pools != nil && !req.GetSkipPool() {
		if pool, ok := m.pools.Match(shapeOf(r, netName)); ok {
			vm, claimed, err := m.claim(ctx, pool, r, netName, lifetime, createdBy)
			if err != nil && !claimed {
				return nil, err // refused (the name is taken, shutting down): neither a hit nor a miss
			}
			m.pools.Counted(pool, claimed)
			if claimed {
				return vm, err
			}
		}
	}
	return m.create(ctx, r, netName, lifetime, createdBy, "")
}

// allocate makes a VM's record, lease and directory for r and returns it
// with its op lock held, not yet prepared or launched (create's first half;
// a fork's too, whose tweak makes it its parent's copy before it is stored).
// pool names the warm pool of a member being made (pool.go).
func (m *Manager) allocate(ctx context.Context, r *request, netName string, lifetime *hypervisorv1.Lifetime, createdBy, pool string, tweak func(*storepb.VirtualMachine)) (*machine, *storepb.VirtualMachine, []byte, error) {
	m.table.mu.Lock()
	if m.table.closing {
		m.table.mu.Unlock()
		return nil, nil, nil, apierr.Errorf(apierr.Conflict, "vm-manager is shutting down")
	}
	if n, max := len(m.table.machines), m.cfg.Limits.MaxVMs; n >= max {
		m.table.mu.Unlock()
		return nil, nil, nil, m.refused.refuse(limitVMs, "this host has %d VMs, the maximum is %d (--max-vms): delete one first", n, max)
	}
	for _, other := range m.table.machines {
		other.mu.Lock()
		name, id := other.rec.GetName(), other.id
		other.mu.Unlock()
		if name == r.name {
			m.table.mu.Unlock()
			return nil, nil, nil, apierr.Errorf(apierr.Conflict, "vm name %q is in use by %s", r.name, id)
		}
	}
	id := m.table.freeIDLocked()
	if pool != "" {
		// A dot is in no DNS label: a caller's name never collides with it.
		r.name, r.hostname = memberName(pool, id), "member-"+id
	}
	machineID := make([]byte, 16)
	_, _ = rand.Read(machineID)
	dir := m.table.vmDir(id)
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
		Paths:              PathsIn(dir),
		Lifetime:           lifetime,
		Pool:               pool,
	}
	sshKey, err := newSSHKey(rec)
	if err != nil {
		m.table.mu.Unlock()
		return nil, nil, nil, apierr.Errorf(apierr.Internal, "per-VM SSH key: %v", err)
	}
	if r.userData != "" {
		rec.Paths.UserData = filepath.Join(dir, "user-data")
	}
	switch r.image.GetKind() {
	case hypervisorv1.ImageKind_IMAGE_KIND_UKI:
		rec.Paths.Volume = filepath.Join(dir, "disk.raw")
	case hypervisorv1.ImageKind_IMAGE_KIND_OCI:
		// The writable overlay over the image's read-only root.
		rec.Paths.Volume = filepath.Join(dir, "disk.raw")
		o := r.image.GetOci()
		rec.OciImage = &hypervisorv1.OciImageRef{Reference: o.GetReference(), ManifestDigest: o.GetManifestDigest(), RootHash: o.GetRootHash()}
	}
	if tweak != nil {
		tweak(rec)
	}
	mc := &machine{id: id, rec: rec, changed: make(chan struct{}), trace: trace.SpanContextFromContext(ctx)}
	mc.op.Lock()
	m.table.machines[id] = mc
	m.table.mu.Unlock()
	if netName != "" {
		ip, mac, err := m.nets.Attach(netName, id)
		if err != nil {
			m.discard(mc)
			mc.op.Unlock()
			return nil, nil, nil, err
		}
		mc.mu.Lock()
		rec.Network, rec.Ip, rec.Mac, rec.Zone = netName, ip.String(), mac, netName
		mc.mu.Unlock()
		m.table.mu.Lock()
		m.table.leases[lease{netName, ip.Unmap()}] = mc
		m.table.mu.Unlock()
	}

	// The directory, marked, before the record: a restart in between sweeps it.
	if err := m.table.makeDir(id); err != nil {
		m.discard(mc)
		mc.op.Unlock()
		return nil, nil, nil, apierr.Errorf(apierr.Internal, "vm directory: %v", err)
	}
	if err := m.store.PutVM(rec); err != nil {
		m.discard(mc)
		mc.op.Unlock()
		return nil, nil, nil, err
	}
	m.table.events.Publish(lifecycle.Event{VMID: id, To: hypervisorv1.State_STATE_CREATING, Record: proto.Clone(rec).(*storepb.VirtualMachine)})
	m.table.unmark(id)
	return mc, rec, sshKey, nil
}

// create allocates and boots a VM of r, then waits per wait_for. pool names
// the warm pool of a member being made (pool.go): its record is hidden and
// named after it.
func (m *Manager) create(ctx context.Context, r *request, netName string, lifetime *hypervisorv1.Lifetime, createdBy, pool string) (*hypervisorv1.VirtualMachine, error) {
	mc, rec, sshKey, err := m.allocate(ctx, r, netName, lifetime, createdBy, pool, nil)
	if err != nil {
		return nil, err
	}
	id := mc.id
	err = m.prepare(rec, r, sshKey)
	if err == nil {
		phase := hypervisorv1.Phase_PHASE_BOOT
		if r.image.GetKind() == hypervisorv1.ImageKind_IMAGE_KIND_UKI {
			phase = hypervisorv1.Phase_PHASE_INSTALL
		}
		err = m.runner.launch(mc, phase)
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
	if err := m.table.markDeleted(mc.id); err != nil {
		return apierr.Errorf(apierr.Internal, "delete vm %s: %v", mc.id, err)
	}
	if err := m.store.DeleteVM(mc.id); err != nil {
		m.table.unmark(mc.id)
		return err
	}
	m.table.mu.Lock()
	delete(m.table.machines, mc.id)
	mc.mu.Lock()
	if l, ok := leaseOf(mc.rec); ok && m.table.leases[l] == mc {
		delete(m.table.leases, l)
	}
	mc.mu.Unlock()
	m.table.mu.Unlock()
	if n := mc.rec.GetNetwork(); n != "" {
		m.nets.Detach(n, mc.id)
	}
	m.table.removeDir(mc.id)
	m.imds.Forget(mc.id)
	mc.mu.Lock()
	last := mc.rec.GetState()
	close(mc.changed)
	mc.changed = make(chan struct{})
	mc.mu.Unlock()
	m.table.gone(mc.id, last)
	return nil
}
