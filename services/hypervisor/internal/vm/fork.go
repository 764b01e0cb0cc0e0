package vm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/guestapi"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/lifecycle"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/sshexec"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// A fork is a new VM made from a running VM's snapshot (RAM, devices): the
// parent pauses for the save only. Each fork has its own id, name, lease
// (MAC and address) and directory, and a vTPM of its own made by the driver
// (fresh EK and AK, the parent's verified measurements replayed), registered
// with attestation as a fork of the parent before its first instruction
// runs. The host then tells the guest over its notify port (vm-agent's
// fork.go), which takes the new MAC and address, reseeds its random pool,
// makes a new SSH host key, quotes with the fork's AK and sends READY=1.
//
// A disk is forked copy-on-write: the parent's active layer is frozen in
// the pause and each fork writes an overlay of its own over it
// (driver/forkdisk.go).
//
// Not yet: hosts whose readiness travels over vsock (the fork message goes
// over virtio-serial).

// Forker is a Driver that can fork a running VM (driver/fork.go).
type Forker interface {
	// Snapshot pauses run, freezes its disk (the parent goes on in a new
	// layer, which persistVolume records before QEMU writes it), saves its
	// state into dir and continues it.
	Snapshot(ctx context.Context, rec *storepb.VirtualMachine, run Run, dir string, persistVolume func(string) error) (ForkSnapshot, error)
	// PrepareFork makes child's vTPM state from the parent's verified logs
	// and its disk over the parent's (setting child's volume), and returns
	// its keys. It runs before the parent's snapshot: the layers it reads
	// are the ones the snapshot freezes.
	PrepareFork(ctx context.Context, child, parent *storepb.VirtualMachine, firmwareLog, userspaceLog []byte) (*storepb.TpmKeys, error)
	// LaunchFork starts child with its prepared vTPM and loads src's
	// snapshot into it once there is one.
	LaunchFork(ctx context.Context, l Launch, src *ForkSource) (Run, error)
}

// ForkSnapshot is what a fork starts from.
type ForkSnapshot struct {
	Pause    time.Duration // the parent's vCPUs stopped
	State    string        // the saved RAM and devices
	OVMFVars string        // the firmware's variables as of the pause
}

// forkSnapshotPrefix names a fork's snapshot directory in the parent's; it
// lives for the call (sweepForkSnapshots removes what a crash left).
const forkSnapshotPrefix = "fork-"

// MaxForks bounds one ForkVirtualMachine call.
const MaxForks = 16

// forkMessage is what a fork's vm-agent reads on its notify port.
func forkMessage(rec *storepb.VirtualMachine) []byte {
	seed := make([]byte, 32)
	_, _ = rand.Read(seed)
	msg := fmt.Appendf(nil, "VMM_FORK=1\nVMM_FORK_MAC=%s\nVMM_FORK_SEED=%s\nVMM_FORK_PARENT=%s", rec.GetMac(), hex.EncodeToString(seed), rec.GetForkedFrom())
	if rec.GetIp() != "" {
		// The fork's lease: the guest applies it at once instead of asking
		// DHCP (the network, its gateway and DNS are the parent's).
		msg = fmt.Appendf(msg, "\nVMM_FORK_IP=%s", rec.GetIp())
	}
	return msg
}

// Fork makes count VMs of the running VM id's snapshot and waits per
// waitFor (none or ready).
func (m *Manager) Fork(ctx context.Context, req *hypervisorv1.ForkVirtualMachineRequest, createdBy string) (*hypervisorv1.ForkVirtualMachineResponse, error) {
	count := int(req.GetCount())
	if count == 0 {
		count = 1
	}
	if count < 1 || count > MaxForks {
		return nil, apierr.Invalidf("count", "count %d is not within 1..%d", count, MaxForks)
	}
	waitFor := req.GetWaitFor()
	if waitFor == hypervisorv1.WaitFor_WAIT_FOR_UNSPECIFIED {
		waitFor = hypervisorv1.WaitFor_WAIT_FOR_READY
	}
	if waitFor != hypervisorv1.WaitFor_WAIT_FOR_READY && waitFor != hypervisorv1.WaitFor_WAIT_FOR_NONE {
		return nil, apierr.Invalidf("wait_for", "a fork waits for none or ready")
	}
	f, ok := m.driver.(Forker)
	if !ok {
		return nil, apierr.Errorf(apierr.Conflict, "this host's driver cannot fork VMs")
	}
	parent, err := m.table.get(req.GetId())
	if err != nil {
		return nil, err
	}
	m.table.mu.Lock()
	n, max := len(m.table.machines), m.cfg.Limits.MaxVMs
	m.table.mu.Unlock()
	if n+count > max {
		return nil, m.refused.refuse(limitVMs, "this host has %d VMs, %d forks would pass the maximum of %d (--max-vms)", n, count, max)
	}

	parent.op.Lock()
	rec, _ := parent.snapshot()
	parent.mu.Lock()
	rt := parent.run
	parent.mu.Unlock()
	var fw, us []byte
	switch st := rec.GetState(); {
	case rt == nil || (st != hypervisorv1.State_STATE_READY && st != hypervisorv1.State_STATE_RUNNING) || rt.phase != hypervisorv1.Phase_PHASE_BOOT:
		err = apierr.Errorf(apierr.Conflict, "vm %s is %s; only a ready or running vm can be forked", rec.GetId(), lifecycle.Name(st))
	case isMember(rec):
		err = apierr.Errorf(apierr.Conflict, "vm %s is a warm pool's member: claim it first", rec.GetId())
	default:
		if fw, us, err = guestapi.VerifiedLogs(rec.GetPaths().GetDir()); err != nil {
			err = apierr.Errorf(apierr.Conflict, "vm %s has no verified quote whose measurements a fork could take: %v", rec.GetId(), err)
		}
	}
	if err != nil {
		parent.op.Unlock()
		return nil, err
	}
	snapDir := filepath.Join(rec.GetPaths().GetDir(), forkSnapshotPrefix+newID())
	if err := os.MkdirAll(snapDir, 0o700); err != nil {
		parent.op.Unlock()
		return nil, apierr.Errorf(apierr.Internal, "fork snapshot directory: %v", err)
	}
	defer os.RemoveAll(snapDir)
	// The forks are made, and their processes started, while the parent
	// saves: each waits for the snapshot only to load it.
	src := newForkSource()
	forks := make([]*machine, count)
	errs := make([]error, count)
	var wg sync.WaitGroup
	for i := range count {
		wg.Go(func() {
			forks[i], errs[i] = m.forkOne(ctx, f, rec, fw, us, src, createdBy, i)
		})
	}
	snap, err := src.snapshot(m.ctx, func(ctx context.Context) (ForkSnapshot, error) {
		return f.Snapshot(ctx, rec, rt.proc, snapDir, func(volume string) error {
			m.table.update(parent, func(r *storepb.VirtualMachine) { r.Paths.Volume = volume })
			return nil
		})
	})
	parent.op.Unlock()
	wg.Wait()
	out := &hypervisorv1.ForkVirtualMachineResponse{PauseSeconds: snap.Pause.Seconds()}
	if err != nil {
		return out, apierr.Errorf(apierr.VMFailed, "vm %s could not be snapshotted (it runs on): %v", rec.GetId(), err)
	}
	m.log.Info("vm snapshotted for forks", "vm", rec.GetId(), "forks", count, "paused_seconds", snap.Pause.Seconds())
	if err := errors.Join(errs...); err != nil {
		return out, err
	}
	for _, mc := range forks {
		got, err := m.wait(ctx, mc, waitFor, m.cfg.BootTimeout)
		if err != nil {
			return out, err
		}
		out.Vms = append(out.Vms, View(got))
	}
	return out, nil
}

// forkOne makes and starts one fork of parent from src.
func (m *Manager) forkOne(ctx context.Context, f Forker, parent *storepb.VirtualMachine, fw, us []byte, src *ForkSource, createdBy string, i int) (*machine, error) {
	img, err := m.images.Get(parent.GetImage())
	if err != nil {
		return nil, apierr.Errorf(apierr.Conflict, "vm %s: its image %s is no longer in the catalog", parent.GetId(), parent.GetImage())
	}
	r := &request{
		// A placeholder that no DNS label equals: the name takes the id.
		name: "fork." + parent.GetId(), image: img, kubernetesVersion: parent.GetKubernetesVersion(),
		cpus: parent.GetCpus(), memoryMiB: parent.GetMemoryMib(), diskGiB: parent.GetDiskGib(),
		sshKeys: parent.GetSshAuthorizedKeys(), metadata: parent.GetMetadata(), requireAttestation: parent.GetRequireAttestation(),
	}
	mc, rec, _, err := m.allocate(ctx, r, parent.GetNetwork(), nil, createdBy, "", func(x *storepb.VirtualMachine) {
		// Named after its id: unique, and never a name a deleted VM had.
		x.Name = forkName(parent.GetName(), x.GetId())
		x.Hostname = x.Name
		// The guest authorizes the parent's per-VM key: the fork's is a copy.
		x.SshPublicKey, x.ForkedFrom, x.MachineId = parent.GetSshPublicKey(), parent.GetId(), parent.GetMachineId()
		// Installed and booted as its parent: a later cold boot of the fork
		// neither installs nor runs first-boot provisioning again.
		x.InstalledAt, x.Booted = parent.GetInstalledAt(), parent.GetBooted()
		// PrepareFork makes the disk, over the parent's.
		x.Paths.Volume = ""
	})
	if err != nil {
		return nil, err
	}
	err = m.prepareFork(rec, parent)
	var keys *storepb.TpmKeys
	if err == nil {
		keys, err = f.PrepareFork(ctx, rec, parent, fw, us)
	}
	if err == nil && rec.GetPaths().GetVolume() != "" {
		m.table.update(mc, func(r *storepb.VirtualMachine) { r.Paths.Volume = rec.GetPaths().GetVolume() })
	}
	if err == nil {
		err = m.runner.start(mc, hypervisorv1.Phase_PHASE_BOOT,
			func(context.Context, *storepb.VirtualMachine) (*storepb.TpmKeys, error) { return keys, nil },
			func(ctx context.Context, l Launch) (Run, error) { return f.LaunchFork(ctx, l, src) })
	}
	mc.op.Unlock()
	if err != nil {
		m.discard(mc)
		return nil, apierr.Errorf(apierr.VMFailed, "fork %d of vm %s could not start: %v", i+1, parent.GetId(), err)
	}
	m.log.Info("vm forked", "vm", rec.GetId(), "parent", parent.GetId(), "ak", fmt.Sprintf("%x", keys.GetAkName())[:16])
	m.tellFork(rec)
	return mc, nil
}

// tellFork sends a fork its message once its notify port is attached.
func (m *Manager) tellFork(rec *storepb.VirtualMachine) {
	m.wg.Go(func() {
		sctx, cancel := context.WithTimeout(m.ctx, 30*time.Second)
		defer cancel()
		if err := m.runner.router.SendSerial(sctx, rec.GetId(), forkMessage(rec)); err != nil {
			m.log.Warn("tell a fork it is one", "vm", rec.GetId(), "error", err)
		}
	})
}

// prepareFork writes the fork's directory: the parent's per-VM SSH key
// (the guest authorizes it) and what the driver needs.
func (m *Manager) prepareFork(rec, parent *storepb.VirtualMachine) error {
	if err := os.Chmod(rec.GetPaths().GetDir(), 0o700); err != nil {
		return err
	}
	key, err := os.ReadFile(parent.GetPaths().GetSshKey())
	if err != nil {
		return fmt.Errorf("the parent's per-VM SSH key: %w", err)
	}
	if err := sshexec.WriteKey(rec.GetPaths().GetSshKey(), key); err != nil {
		return err
	}
	return m.driver.Prepare(rec)
}

// forkName is "<parent>-fork-<id>", the parent's name cut to fit a DNS label.
func forkName(parent, id string) string {
	suffix := "-fork-" + id
	return strings.TrimRight(parent[:min(len(parent), 63-len(suffix))], "-") + suffix
}

// resendForkMessages tells the forks a previous hypervisor started, and
// that have not reported ready since, that they are forks: it may have
// stopped before it told them (vm-agent handles the message again
// harmlessly).
func (m *Manager) resendForkMessages() {
	for _, rec := range m.table.Records() {
		if rec.GetForkedFrom() == "" || rec.GetReadyAt() != nil || rec.GetBootCount() != 1 || rec.GetProcesses() == nil {
			continue
		}
		if s := rec.GetState(); s != hypervisorv1.State_STATE_BOOTING && s != hypervisorv1.State_STATE_ATTESTING && s != hypervisorv1.State_STATE_RUNNING {
			continue
		}
		m.log.Info("telling a fork again that it is one (vm-manager restarted before it was ready)", "vm", rec.GetId(), "parent", rec.GetForkedFrom())
		m.tellFork(rec)
	}
}
