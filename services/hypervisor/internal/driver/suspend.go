package driver

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/qemu"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/swtpm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// Suspend writes a VM's RAM, device state and vTPM state (swtpm's state
// travels in QEMU's migration stream) to <vm>/suspend/state.bin, with a
// manifest that binds it to the VM and its vTPM, then ends QEMU (swtpm ends
// with it). Resume starts QEMU with the same argv plus -incoming and loads
// the file.

const (
	suspendDir   = "suspend"
	stateFile    = "state.bin"
	manifestFile = "manifest.json"
	// maxBandwidth lifts QEMU's migration cap (~128 MiB/s): a save to local
	// disk runs at disk speed.
	maxBandwidth   = int64(1) << 40
	manifestFormat = 1
)

// Manifest describes a saved state; resume refuses one that does not match
// the VM it is asked to resume.
type Manifest struct {
	Format int    `json:"format"`
	VMID   string `json:"vm_id"`
	// Fingerprints (SHA-256 of the TPM2B public areas) of the vTPM the
	// state was saved with: the state carries that vTPM's keys.
	EKSHA256    string    `json:"ek_sha256"`
	AKSHA256    string    `json:"ak_sha256"`
	QEMUVersion string    `json:"qemu_version"`
	Argv        []string  `json:"argv"` // QEMU's, without argv[0]
	ArgvSHA256  string    `json:"argv_sha256"`
	Size        int64     `json:"size"`
	CRC32C      uint32    `json:"crc32c"`
	SavedAt     time.Time `json:"saved_at"`
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// savedDir is <vm>/suspend; "" for a record without a directory (never
// a path relative to the working directory).
func savedDir(rec *storepb.VirtualMachine) string {
	dir := rec.GetPaths().GetDir()
	if dir == "" || !filepath.IsAbs(dir) && filepath.Clean(dir) == "." {
		return ""
	}
	return filepath.Join(dir, suspendDir)
}

var errNoDir = errors.New("the vm record names no directory")

// SavedDir is where a VM's saved state lives (tests and the fault suite look).
func SavedDir(vmDir string) string { return filepath.Join(vmDir, suspendDir) }

func fingerprint(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func argvHash(argv []string) string {
	h := sha256.New()
	for _, a := range argv {
		h.Write([]byte(a))
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil))
}

// Suspend saves the VM of run and ends its processes. On an error before
// the state is complete, the guest's vCPUs run again and nothing is kept.
func (d *Driver) Suspend(ctx context.Context, rec *storepb.VirtualMachine, vr vm.Run) error {
	r, ok := vr.(*run)
	if !ok || r.mon == nil {
		return fmt.Errorf("this run cannot be suspended (no QMP connection)")
	}
	argv, err := cmdline(r.qemu.PID)
	if err != nil {
		return err
	}
	if v := rec.GetPaths().GetVolume(); v != "" {
		// QEMU's argv names the disk it started with; a fork since may
		// have frozen that layer below a new one, which the record names.
		argv = qemu.ReplaceTargetDrive(argv, v)
	}
	dir := savedDir(rec)
	if dir == "" {
		return errNoDir
	}
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	tmp := filepath.Join(dir, stateFile+".part")
	fail := func(err error) error {
		// Continue the guest where it was: a suspend that fails changes nothing.
		cctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = r.mon.MigrateCancel(cctx)
		if cerr := r.mon.Cont(cctx); cerr != nil {
			err = fmt.Errorf("%w (and the guest could not be continued: %v)", err, cerr)
		}
		_ = os.RemoveAll(dir)
		return err
	}
	if err := r.mon.SetMaxBandwidth(ctx, maxBandwidth); err != nil {
		return fail(err)
	}
	// Paused first: the stream is then one pass over RAM, no dirty-page rounds.
	if err := r.mon.Stop(ctx); err != nil {
		return fail(err)
	}
	// QEMU writes the file's descriptor itself: once completed, it is whole.
	if err := migrateToFile(ctx, r.mon, tmp); err != nil {
		return fail(fmt.Errorf("save the vm's state: %w", err))
	}
	size, sum, err := syncAndSum(tmp)
	if err != nil {
		return fail(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, stateFile)); err != nil {
		return fail(err)
	}
	man := Manifest{
		Format: manifestFormat, VMID: rec.GetId(),
		EKSHA256: fingerprint(rec.GetTpm().GetEkPublic()), AKSHA256: fingerprint(rec.GetTpm().GetAkPublic()),
		QEMUVersion: r.mon.Version().String(), Argv: argv[1:], ArgvSHA256: argvHash(argv[1:]),
		Size: size, CRC32C: sum, SavedAt: time.Now().UTC(),
	}
	// The manifest last, renamed into place: its presence means the state is whole.
	if err := writeFileSync(filepath.Join(dir, manifestFile), man); err != nil {
		return fail(err)
	}
	// From here the state is saved: end QEMU (swtpm follows, --terminate).
	if err := r.mon.Quit(ctx); err != nil {
		d.log.Warn("quit after suspend failed; terminating qemu", "vm", rec.GetId(), "error", err)
		r.qemu.Terminate(d.cfg.KillGrace)
	}
	select {
	case <-r.qemu.Done():
	case <-time.After(d.cfg.KillGrace):
		r.qemu.Terminate(d.cfg.KillGrace)
	}
	r.tpm.Terminate(d.cfg.KillGrace)
	return nil
}

// AbortSuspend undoes a suspend a restarted hypervisor found in flight on an
// adopted run: the migration cancelled, the guest continued, the partial
// state removed.
func (d *Driver) AbortSuspend(ctx context.Context, rec *storepb.VirtualMachine, vr vm.Run) error {
	r, ok := vr.(*run)
	if !ok || r.mon == nil {
		return fmt.Errorf("no QMP connection")
	}
	if err := r.mon.MigrateCancel(ctx); err != nil {
		return err
	}
	if err := r.mon.Cont(ctx); err != nil {
		return err
	}
	return d.DiscardSaved(rec)
}

// Saved checks that rec has a whole saved state bound to it (manifest and
// file size; the checksum is Resume's).
func (d *Driver) Saved(rec *storepb.VirtualMachine) error {
	_, err := d.checkSaved(rec)
	return err
}

// DiscardSaved removes rec's saved state.
func (d *Driver) DiscardSaved(rec *storepb.VirtualMachine) error {
	dir := savedDir(rec)
	if dir == "" {
		return nil
	}
	// Renamed at once, removed after: a state file of hundreds of MiB takes
	// tens of ms to unlink, which a resume's caller (a pool claim's
	// create→ready) would wait for. A crash before the removal leaves the
	// renamed directory, which the next discard of the VM removes.
	gone := dir + ".discarded"
	_ = os.RemoveAll(gone)
	if err := os.Rename(dir, gone); err != nil {
		if os.IsNotExist(err) {
			return nil
		}
		return os.RemoveAll(dir)
	}
	go func() { _ = os.RemoveAll(gone) }()
	return nil
}

func (d *Driver) checkSaved(rec *storepb.VirtualMachine) (*Manifest, error) {
	dir := savedDir(rec)
	if dir == "" {
		return nil, errNoDir
	}
	raw, err := os.ReadFile(filepath.Join(dir, manifestFile))
	if err != nil {
		return nil, fmt.Errorf("no saved state: %w", err)
	}
	var man Manifest
	if err := json.Unmarshal(raw, &man); err != nil {
		return nil, fmt.Errorf("saved state manifest: %w", err)
	}
	switch {
	case man.Format != manifestFormat:
		return nil, fmt.Errorf("saved state has format %d, this vm-manager reads %d", man.Format, manifestFormat)
	case man.VMID != rec.GetId():
		return nil, fmt.Errorf("saved state belongs to vm %q, not %s", man.VMID, rec.GetId())
	case man.EKSHA256 != fingerprint(rec.GetTpm().GetEkPublic()) || man.AKSHA256 != fingerprint(rec.GetTpm().GetAkPublic()):
		return nil, fmt.Errorf("saved state was made with another vTPM (EK/AK fingerprints differ)")
	case man.ArgvSHA256 != argvHash(man.Argv):
		return nil, fmt.Errorf("saved state manifest: argv does not match its hash")
	case !argvInDir(man.Argv, filepath.Dir(dir)):
		return nil, fmt.Errorf("saved state's qemu arguments name another vm's directory")
	case d.cfg.QEMUVersion != (qemu.Version{}) && man.QEMUVersion != d.cfg.QEMUVersion.String():
		return nil, fmt.Errorf("saved state was made by qemu %s, this host runs %s", man.QEMUVersion, d.cfg.QEMUVersion)
	}
	fi, err := os.Stat(filepath.Join(dir, stateFile))
	if err != nil {
		return nil, fmt.Errorf("saved state file: %w", err)
	}
	if fi.Size() != man.Size {
		return nil, fmt.Errorf("saved state file has %d bytes, its manifest says %d", fi.Size(), man.Size)
	}
	return &man, nil
}

// argvInDir says whether the QMP socket argv names is in vmDir: the argv of
// a state copied from another VM names that VM's files.
func argvInDir(argv []string, vmDir string) bool {
	i := slices.Index(argv, "-qmp")
	return i >= 0 && i+1 < len(argv) && strings.Contains(argv[i+1], vmDir+"/")
}

// Resume starts swtpm and QEMU from rec's saved state and continues the
// guest. On an error nothing runs and the saved state is kept.
func (d *Driver) Resume(ctx context.Context, l vm.Launch) (vm.Run, error) {
	rec := l.Record
	man, err := d.checkSaved(rec)
	if err != nil {
		return nil, err
	}
	dir := savedDir(rec)
	state := filepath.Join(dir, stateFile)
	// The checksum runs while swtpm and QEMU start; the stream is only
	// loaded once it matched.
	sumErr := make(chan error, 1)
	go func() {
		_, sum, err := sumFile(state, false)
		if err == nil && sum != man.CRC32C {
			err = fmt.Errorf("saved state file is corrupt (crc32c %08x, manifest %08x)", sum, man.CRC32C)
		}
		sumErr <- err
	}()
	p := rec.GetPaths()
	// swtpm on the VM's state dir as it is: the stream's vTPM state replaces
	// what swtpm loaded, and a failed resume leaves the directory as saved.
	tpm, err := swtpm.Start(ctx, swtpm.Config{Binary: d.cfg.SwtpmBinary, StateDir: p.GetTpmState()})
	if err != nil {
		<-sumErr
		return nil, err
	}
	// A fork's first run talked to its swtpm through a proxy (fork.go),
	// which ended with that QEMU: the resumed one talks to swtpm itself.
	proxy, ctrl := filepath.Join(p.GetDir(), forkProxySocket), swtpm.Config{StateDir: p.GetTpmState()}.WithDefaults().CtrlSocket
	args := make([]string, 0, len(man.Argv)+2)
	for _, a := range man.Argv {
		args = append(args, strings.ReplaceAll(a, proxy, ctrl))
	}
	args = append(args, "-incoming", "defer")
	qp, mon, err := d.startQEMU(ctx, p, args)
	if err != nil {
		<-sumErr
		tpm.Terminate(d.cfg.KillGrace)
		return nil, err
	}
	r := &run{qemu: qp, tpm: tpm, mon: mon, cid: rec.GetCid(), grace: d.cfg.KillGrace}
	abort := func(err error) (vm.Run, error) {
		_ = mon.Close()
		qp.Terminate(d.cfg.KillGrace)
		tpm.Terminate(d.cfg.KillGrace)
		return nil, err
	}
	if err := <-sumErr; err != nil {
		return abort(err)
	}
	qctx, cancel := qp.While(ctx)
	defer cancel()
	if err := migrateFromFile(qctx, mon, state); err != nil {
		return abort(fmt.Errorf("load the saved state: %w", err))
	}
	if err := mon.Cont(qctx); err != nil {
		return abort(fmt.Errorf("continue the guest: %w", err))
	}
	return r, nil
}

// cmdline is a process's argv.
func cmdline(pid int) ([]string, error) {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return nil, err
	}
	argv := strings.Split(strings.TrimSuffix(string(raw), "\x00"), "\x00")
	if len(argv) < 2 {
		return nil, fmt.Errorf("qemu pid %d: empty command line", pid)
	}
	if slices.Contains(argv, "-incoming") {
		// A resumed QEMU: its argv without the incoming flag is the device list.
		i := slices.Index(argv, "-incoming")
		if i+1 < len(argv) {
			argv = slices.Delete(argv, i, i+2)
		}
	}
	return argv, nil
}

// syncAndSum flushes path to disk and returns its size and CRC-32C.
func syncAndSum(path string) (int64, uint32, error) { return sumFile(path, true) }

func sumFile(path string, sync bool) (int64, uint32, error) {
	f, err := os.Open(path) // fsync works on a read-only descriptor too
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	h := crc32.New(castagnoli)
	n, err := io.Copy(h, f)
	if err != nil {
		return 0, 0, err
	}
	if sync {
		if err := f.Sync(); err != nil {
			return 0, 0, err
		}
	}
	return n, h.Sum32(), nil
}

func writeFileSync(path string, v any) error {
	raw, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(raw)
	if serr := f.Sync(); err == nil {
		err = serr
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return errors.Join(err, os.Remove(tmp))
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	dirf, err := os.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer dirf.Close()
	return dirf.Sync()
}

// migrateToFile saves the state of the VM mon runs into a new file at path;
// QEMU writes the descriptor itself, which is then whole.
func migrateToFile(ctx context.Context, mon *qemu.Monitor, path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	return mon.MigrateToFile(ctx, f)
}

// migrateFromFile loads the state at path into the QEMU mon runs.
func migrateFromFile(ctx context.Context, mon *qemu.Monitor, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return mon.MigrateIncomingFile(ctx, f)
}
