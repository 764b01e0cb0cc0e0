package driver

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/logtail"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/proc"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/qemu"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/swtpm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/tpmfork"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// A fork starts from its parent's snapshot (RAM, devices, the migration
// stream's vTPM blobs) with a vTPM of its own: QEMU's incoming migration
// hands swtpm the parent's permanent and volatile state over the control
// channel, and tpmfork's proxy, between the two, replaces them with the
// fork's, made on a host swtpm (fresh EK and AK, the parent's verified
// measurements replayed). The fork never holds the parent's keys.

// forkBlobs are the fork's prepared vTPM state, below its directory until
// its launch.
const (
	forkBlobDir      = "fork-tpm"
	forkPermanent    = "permanent"
	forkVolatile     = "volatile"
	forkProxySocket  = "tpm-fork.sock"
	forkProxyReport  = "tpm-fork.json"
	forkProxyLog     = "tpm-proxy.log"
	snapshotFileName = "state.bin"
)

// Snapshot pauses the VM of vr, writes its state to dir/state.bin, makes
// a new overlay its disk's active layer (the layer below, frozen, is what
// forks start from) and continues it. persistVolume records the parent's
// new active layer before QEMU switches to it: an empty overlay over the
// layer QEMU writes reads the same, so a crash on either side of the switch
// leaves a record that names the disk's content.
func (d *Driver) Snapshot(ctx context.Context, rec *storepb.VirtualMachine, vr vm.Run, dir string, persistVolume func(string) error) (vm.ForkSnapshot, error) {
	r, ok := vr.(*run)
	if !ok || r.mon == nil {
		return vm.ForkSnapshot{}, fmt.Errorf("this run cannot be snapshotted (no QMP connection)")
	}
	if d.cfg.NotifyVsockPort != 0 {
		// The fork learns it is one over the virtio-serial notify port.
		return vm.ForkSnapshot{}, fmt.Errorf("forks need the virtio-serial notify port; this host reports readiness over vsock")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return vm.ForkSnapshot{}, err
	}
	snap := vm.ForkSnapshot{State: filepath.Join(dir, snapshotFileName), OVMFVars: filepath.Join(dir, "ovmf_vars.fd")}
	active := rec.GetPaths().GetVolume()
	var overlay string
	if active != "" {
		// A chain the forks could not take (too long, a foreign layer)
		// refuses the fork before the parent gets another layer.
		if _, err := diskChain(active); err != nil {
			return snap, err
		}
		overlay = filepath.Join(filepath.Dir(active), newLayerName())
		if err := d.createOverlay(ctx, overlay, active); err != nil {
			return snap, err
		}
		if err := persistVolume(overlay); err != nil {
			_ = os.Remove(overlay)
			return snap, err
		}
	}
	if err := r.mon.SetMaxBandwidth(ctx, maxBandwidth); err != nil {
		return snap, err
	}
	start := time.Now()
	err := r.mon.Stop(ctx)
	if err == nil && overlay != "" {
		if err = r.mon.SnapshotDrive(ctx, qemu.TargetDriveID, overlay); err != nil {
			// QEMU still writes the layer it had: the record names it again.
			if perr := persistVolume(active); perr == nil {
				_ = os.Remove(overlay)
			}
			err = fmt.Errorf("freeze the disk: %w", err)
		}
	}
	if err == nil {
		// The firmware's variables as the paused guest left them (pflash
		// writes go to the file; the stream carries the flash's contents).
		err = copyVars(rec.GetPaths().GetOvmfVars(), snap.OVMFVars)
	}
	if err == nil {
		err = migrateToFile(ctx, r.mon, snap.State)
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err != nil {
		_ = r.mon.MigrateCancel(cctx)
	}
	if cerr := r.mon.Cont(cctx); cerr != nil && err == nil {
		err = fmt.Errorf("continue the parent: %w", cerr)
	}
	snap.Pause = time.Since(start)
	if err != nil {
		_ = os.RemoveAll(dir)
		return snap, fmt.Errorf("snapshot: %w", err)
	}
	return snap, nil
}

// PrepareFork makes child's vTPM state (kept below its directory for
// LaunchFork) from the parent's verified logs, and returns its keys; with
// a disk, it links the parent's layers into the child's directory and
// sets child's volume to an overlay of its own over them. It runs before
// the parent's snapshot freezes the top one: the fork's QEMU opens the
// chain inactive (-incoming) and reads it only once the state is loaded,
// after the freeze.
func (d *Driver) PrepareFork(ctx context.Context, child, parent *storepb.VirtualMachine, firmwareLog, userspaceLog []byte) (*storepb.TpmKeys, error) {
	replay, err := tpmfork.Replay(firmwareLog, userspaceLog)
	if err != nil {
		return nil, fmt.Errorf("the parent's verified measurements: %w", err)
	}
	dir := child.GetPaths().GetDir()
	if v := parent.GetPaths().GetVolume(); v != "" {
		chain, err := diskChain(v)
		if err != nil {
			return nil, err
		}
		top, err := linkChain(chain, dir)
		if err != nil {
			return nil, err
		}
		own := filepath.Join(dir, newLayerName())
		if err := d.createOverlay(ctx, own, top); err != nil {
			return nil, err
		}
		child.Paths.Volume = own
	}
	tmp, err := os.MkdirTemp(dir, "tpm-prep-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	p, err := tpmfork.Prepare(ctx, swtpm.Config{Binary: d.cfg.SwtpmBinary, StateDir: tmp}, d.cfg.VTPMCA, child.GetId(), replay, tpmfork.Options{})
	if err != nil {
		return nil, err
	}
	blobDir := filepath.Join(dir, forkBlobDir)
	if err := os.MkdirAll(blobDir, 0o700); err != nil {
		return nil, err
	}
	for name, b := range map[string][]byte{forkPermanent: p.Permanent, forkVolatile: p.Volatile} {
		if err := os.WriteFile(filepath.Join(blobDir, name), b, 0o600); err != nil {
			return nil, err
		}
	}
	now := timestamppb.Now()
	return &storepb.TpmKeys{
		AkPublic: bytes.Clone(p.Identity.AK.Public), EkPublic: bytes.Clone(p.Identity.EK.Public),
		AkName: bytes.Clone(p.Identity.AK.Name.Buffer), EkCertificate: bytes.Clone(p.Identity.EKCertificate),
		ProvisionTime: now, UpdateTime: now,
	}, nil
}

// LaunchFork starts the child l from the parent's snapshot: swtpm on the
// child's empty vTPM directory behind the proxy that gives QEMU's incoming
// migration the child's blobs, QEMU with the child's command line and
// -incoming (while the parent saves), the snapshot loaded once src has it,
// then cont once the proxy saw swtpm accept both blobs. The
// proxy relays the control channel for this run (TPM commands use the
// data channel, which QEMU hands swtpm directly); the prepared blobs are
// removed.
func (d *Driver) LaunchFork(ctx context.Context, l vm.Launch, src *vm.ForkSource) (vm.Run, error) {
	rec := l.Record
	p := rec.GetPaths()
	blobDir := filepath.Join(p.GetDir(), forkBlobDir)
	var blobs tpmfork.Blobs
	var err error
	if blobs.Permanent, err = os.ReadFile(filepath.Join(blobDir, forkPermanent)); err != nil {
		return nil, fmt.Errorf("the fork's vTPM state: %w", err)
	}
	if blobs.Volatile, err = os.ReadFile(filepath.Join(blobDir, forkVolatile)); err != nil {
		return nil, fmt.Errorf("the fork's vTPM state: %w", err)
	}
	start := time.Now()
	tcfg := swtpm.Config{Binary: d.cfg.SwtpmBinary, StateDir: p.GetTpmState()}.WithDefaults()
	tpm, err := swtpm.Start(ctx, tcfg)
	if err != nil {
		return nil, err
	}
	sock := filepath.Join(p.GetDir(), forkProxySocket)
	proxy, check, err := d.startProxy(ctx, p, sock, tcfg.CtrlSocket, blobDir, blobs)
	if err != nil {
		tpm.Terminate(d.cfg.KillGrace)
		return nil, err
	}
	spec := d.spec(rec, l.Image, hypervisorv1.Phase_PHASE_BOOT)
	spec.SwtpmSocket = sock
	if d.cfg.NotifyVsockPort != 0 { // the parent's device list, as Launch makes it
		spec.NotifySocket = ""
		spec.VsockCID = d.cid(rec.GetCid(), l.CIDTaken)
		spec.Credentials["vmm.notify_socket"] = fmt.Sprintf("vsock-stream:2:%d", d.cfg.NotifyVsockPort)
	}
	args, err := spec.Args()
	if err != nil {
		_ = proxy.Close()
		tpm.Terminate(d.cfg.KillGrace)
		return nil, err
	}
	qp, mon, err := d.startQEMU(ctx, p, append(args, "-incoming", "defer"))
	if err != nil {
		_ = proxy.Close()
		tpm.Terminate(d.cfg.KillGrace)
		return nil, err
	}
	r := &run{qemu: qp, tpm: tpm, mon: mon, cid: spec.VsockCID, grace: d.cfg.KillGrace, proxy: proxy}
	abort := func(err error) (vm.Run, error) {
		_ = mon.Close()
		qp.Terminate(d.cfg.KillGrace)
		_ = proxy.Close()
		tpm.Terminate(d.cfg.KillGrace)
		return nil, err
	}
	qctx, cancel := qp.While(ctx)
	defer cancel()
	started := time.Now()
	snap, err := src.Wait(qctx)
	if err != nil {
		return abort(err)
	}
	waited := time.Now()
	if err := migrateFromFile(qctx, mon, snap.State); err != nil {
		return abort(fmt.Errorf("load the parent's snapshot: %w", err))
	}
	loaded := time.Now()
	if err := copyVars(snap.OVMFVars, p.GetOvmfVars()); err != nil {
		return abort(fmt.Errorf("the parent's firmware variables: %w", err))
	}
	// Not one instruction of the fork runs before its vTPM is its own.
	if err := check(qctx); err != nil {
		return abort(err)
	}
	if err := mon.Cont(qctx); err != nil {
		return abort(fmt.Errorf("continue the fork: %w", err))
	}
	_ = os.RemoveAll(blobDir)
	d.log.Info("fork launched", "vm", rec.GetId(), "processes_seconds", started.Sub(start).Seconds(),
		"snapshot_wait_seconds", waited.Sub(started).Seconds(), "load_seconds", loaded.Sub(waited).Seconds(),
		"vtpm_check_seconds", time.Since(loaded).Seconds())
	return r, nil
}

// closer ends a proxy: the in-process one, or the process.
type closer func() error

func (c closer) Close() error { return c() }

// startProxy starts the fork's control-channel proxy on sock: a process of
// its own (it outlives the hypervisor: a suspend of the fork needs the
// channel) or, without TPMProxyBinary, in the hypervisor. check says once
// the incoming migration is loaded whether swtpm took the fork's state.
func (d *Driver) startProxy(ctx context.Context, p *hypervisorv1.Paths, sock, ctrl, blobDir string, blobs tpmfork.Blobs) (interface{ Close() error }, func(context.Context) error, error) {
	if d.cfg.TPMProxyBinary == "" {
		px, err := tpmfork.Listen(sock, ctrl, blobs, nil)
		if err != nil {
			return nil, nil, err
		}
		return px, func(context.Context) error { return px.Check() }, nil
	}
	report := filepath.Join(p.GetDir(), forkProxyReport)
	_ = os.Remove(report)
	logf, err := os.OpenFile(filepath.Join(p.GetDir(), forkProxyLog), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, nil, err
	}
	cmd := exec.Command(d.cfg.TPMProxyBinary, "tpm-proxy", "--listen", sock, "--swtpm-ctrl", ctrl,
		"--permanent", filepath.Join(blobDir, forkPermanent), "--volatile", filepath.Join(blobDir, forkVolatile), "--report", report)
	cmd.Stdout, cmd.Stderr = logf, logf // a file: the hypervisor may be gone when it writes
	pp, err := proc.Start(cmd)
	logf.Close()
	if err != nil {
		return nil, nil, fmt.Errorf("start the fork's vTPM proxy: %w", err)
	}
	stop := closer(func() error { pp.Terminate(d.cfg.KillGrace); return nil })
	// QEMU connects at once: the socket must be there.
	for {
		if fi, err := os.Stat(sock); err == nil && fi.Mode().Type() == os.ModeSocket {
			break
		}
		select {
		case <-pp.Done():
			return nil, nil, fmt.Errorf("the fork's vTPM proxy exited%s", logtail.WithHeader(filepath.Join(p.GetDir(), forkProxyLog), 5, ": "))
		case <-ctx.Done():
			_ = stop.Close()
			return nil, nil, ctx.Err()
		case <-time.After(10 * time.Millisecond):
		}
	}
	check := func(ctx context.Context) error {
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		return tpmfork.ReadReport(rctx, report)
	}
	return stop, check, nil
}
