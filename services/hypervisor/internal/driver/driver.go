// Package driver runs a VM as QEMU and swtpm processes (vm.Driver): the
// files a VM needs, its vTPM's provisioning, the QEMU command line, the
// processes started in sessions of their own so that they outlive the
// hypervisor, and their adoption by the next one.
package driver

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/ociboot"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/bootphase"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/logtail"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/proc"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/qemu"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/swtpm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Config is how this host runs VMs.
type Config struct {
	// StateDir holds vms/<id>/; processes naming a directory below it are
	// the driver's.
	StateDir   string
	QEMUBinary string // default qemu-system-x86_64
	// QEMUImgBinary makes a fork's disk overlays; empty takes the qemu-img
	// beside QEMUBinary, else the one on PATH.
	QEMUImgBinary string
	SwtpmBinary   string // default swtpm
	OVMFCode      string
	OVMFVars      string // the template each VM gets a copy of
	// Accelerator is what the host report chose (kvm or tcg).
	Accelerator hypervisorv1.Accelerator
	QEMUVersion qemu.Version
	// CPU is QEMU's -cpu model; empty takes qemu.Spec's default.
	CPU string
	// NotifyVsockPort is the host's AF_VSOCK readiness port on hosts with
	// /dev/vhost-vsock; 0 means readiness travels over virtio-serial.
	NotifyVsockPort uint32
	// VTPMCA signs the EK certificate of every vTPM; nil provisions the keys
	// without one.
	VTPMCA *swtpm.CA
	// KillGrace is the SIGTERM→SIGKILL grace of the driver's own cleanups.
	KillGrace time.Duration
	// TPMProxyBinary runs a fork's vTPM control-channel proxy as a process
	// of its own ("<binary> tpm-proxy", the hypervisor's own executable),
	// which outlives the hypervisor; empty runs it in the hypervisor (tests
	// that run the services in one process).
	TPMProxyBinary string
}

// Driver is the QEMU and swtpm driver.
type Driver struct {
	cfg Config
	log *slog.Logger
}

var _ vm.Driver = (*Driver)(nil)

// New returns the driver.
func New(cfg Config, log *slog.Logger) *Driver {
	if cfg.QEMUBinary == "" {
		cfg.QEMUBinary = "qemu-system-x86_64"
	}
	if cfg.SwtpmBinary == "" {
		cfg.SwtpmBinary = swtpm.DefaultBinary
	}
	if cfg.KillGrace == 0 {
		cfg.KillGrace = 5 * time.Second
	}
	return &Driver{cfg: cfg, log: log}
}

// Prepare copies the OVMF variable store and creates the sparse disk of a
// UKI image's VM.
func (d *Driver) Prepare(rec *storepb.VirtualMachine) error {
	p := rec.GetPaths()
	if err := os.MkdirAll(p.GetTpmState(), 0o700); err != nil {
		return err
	}
	vars, err := os.ReadFile(d.cfg.OVMFVars)
	if err != nil {
		return fmt.Errorf("OVMF vars template: %w", err)
	}
	if err := os.WriteFile(p.GetOvmfVars(), vars, 0o600); err != nil {
		return err
	}
	if p.GetVolume() == "" {
		return nil
	}
	f, err := os.OpenFile(p.GetVolume(), os.O_CREATE|os.O_WRONLY|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(int64(rec.GetDiskGib()) << 30) // sparse
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// Provision reads the vTPM's EK and AK (making what is missing, replacing
// what does not match its template) and returns the keys the record keeps;
// the times say when they were first made and when they last changed.
func (d *Driver) Provision(ctx context.Context, rec *storepb.VirtualMachine) (*storepb.TpmKeys, []string, error) {
	id, err := swtpm.Provision(ctx, swtpm.Config{Binary: d.cfg.SwtpmBinary, StateDir: rec.GetPaths().GetTpmState()}, d.cfg.VTPMCA, rec.GetId())
	if err != nil {
		return nil, nil, fmt.Errorf("provision the vTPM: %w", err)
	}
	old, now := rec.GetTpm(), time.Now()
	keys := &storepb.TpmKeys{
		AkPublic:      bytes.Clone(id.AK.Public),
		EkPublic:      bytes.Clone(id.EK.Public),
		AkName:        bytes.Clone(id.AK.Name.Buffer),
		EkCertificate: bytes.Clone(id.EKCertificate),
		ProvisionTime: old.GetProvisionTime(),
		UpdateTime:    old.GetUpdateTime(),
	}
	if keys.ProvisionTime == nil {
		keys.ProvisionTime = timestamppb.New(now)
	}
	if old == nil || !bytes.Equal(old.GetAkPublic(), keys.AkPublic) || !bytes.Equal(old.GetEkPublic(), keys.EkPublic) || !bytes.Equal(old.GetEkCertificate(), keys.EkCertificate) {
		keys.UpdateTime = timestamppb.New(now)
	}
	return keys, id.Created, nil
}

// Launch starts swtpm (and waits until its control channel answers), then
// QEMU (and waits until QMP answers).
func (d *Driver) Launch(ctx context.Context, l vm.Launch) (vm.Run, error) {
	rec := l.Record
	p := rec.GetPaths()
	var marks bootphase.Processes
	marks.SwtpmStarted = time.Now()
	tpm, err := swtpm.Start(ctx, swtpm.Config{Binary: d.cfg.SwtpmBinary, StateDir: p.GetTpmState()})
	if err != nil {
		return nil, err
	}
	marks.SwtpmReady = time.Now()
	spec := d.spec(rec, l.Image, l.Phase)
	if d.cfg.NotifyVsockPort != 0 {
		spec.NotifySocket = ""
		spec.VsockCID = d.cid(rec.GetCid(), l.CIDTaken)
		spec.Credentials["vmm.notify_socket"] = fmt.Sprintf("vsock-stream:2:%d", d.cfg.NotifyVsockPort)
	}
	for attempt := 0; ; attempt++ {
		args, err := spec.Args()
		if err != nil {
			tpm.Terminate(d.cfg.KillGrace)
			return nil, err
		}
		marks.QEMUStarted = time.Now()
		qp, mon, err := d.startQEMU(ctx, p, args)
		if err == nil {
			marks.QEMUReady = time.Now()
			return &run{qemu: qp, tpm: tpm, mon: mon, cid: spec.VsockCID, grace: d.cfg.KillGrace, marks: marks}, nil
		}
		// QEMU refuses a vsock CID another VM on the host holds: take the next.
		if spec.VsockCID == 0 || attempt >= 16 || !strings.Contains(err.Error(), "guest cid") {
			tpm.Terminate(d.cfg.KillGrace)
			return nil, err
		}
		spec.VsockCID++
	}
}

// startQEMU starts QEMU and connects QMP; a QEMU that does not come up is
// ended and its log tail returned.
func (d *Driver) startQEMU(ctx context.Context, p *hypervisorv1.Paths, args []string) (*proc.Process, *qemu.Monitor, error) {
	log, err := os.OpenFile(p.GetQemuLog(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, nil, err
	}
	// The exact argv, as JSON, so a run can be reproduced by hand (make bench does).
	argv, _ := json.Marshal(append([]string{d.cfg.QEMUBinary}, args...))
	fmt.Fprintf(log, "--- %s %s\n", time.Now().UTC().Format(time.RFC3339), argv)
	cmd := exec.Command(d.cfg.QEMUBinary, args...)
	cmd.Stdout, cmd.Stderr = log, log
	qp, err := proc.Start(cmd)
	log.Close() // the child holds its own descriptor
	if err != nil {
		return nil, nil, err
	}
	// Stop waiting for QMP as soon as QEMU exits (a bad argument, a CID in use).
	qctx, cancel := qp.While(ctx)
	defer cancel()
	mon, err := qemu.Connect(qctx, p.GetQmpSocket())
	if err != nil {
		qp.Terminate(d.cfg.KillGrace)
		return nil, nil, fmt.Errorf("qemu did not come up: %v%s", err, logtail.WithHeader(p.GetQemuLog(), 10, "\nqemu.log:\n"))
	}
	return qp, mon, nil
}

// spec is the QEMU command of one phase.
func (d *Driver) spec(rec *storepb.VirtualMachine, img *hypervisorv1.Image, phase hypervisorv1.Phase) qemu.Spec {
	p := rec.GetPaths()
	accel := qemu.AccelTCG
	if d.cfg.Accelerator == hypervisorv1.Accelerator_ACCELERATOR_KVM {
		accel = qemu.AccelKVM
	}
	s := qemu.Spec{
		ID:           rec.GetId(),
		QEMUVersion:  d.cfg.QEMUVersion,
		Accel:        accel,
		CPU:          d.cfg.CPU,
		CPUs:         int(rec.GetCpus()),
		MemoryMiB:    int(rec.GetMemoryMib()),
		ConsoleLog:   p.GetConsole(),
		QMPSocket:    p.GetQmpSocket(),
		OVMFCode:     d.cfg.OVMFCode,
		OVMFVars:     p.GetOvmfVars(),
		SwtpmSocket:  swtpm.Config{StateDir: p.GetTpmState()}.WithDefaults().CtrlSocket,
		NotifySocket: p.GetNotifySocket(),
		Credentials: map[string]string{
			"system.machine_id":  rec.GetMachineId(),
			"firstboot.hostname": rec.GetHostname(),
		},
	}
	if rec.GetPool() != "" {
		// A warm pool's member gets its hostname with its claim, from the
		// IMDS: a credential would win over it for good.
		delete(s.Credentials, "firstboot.hostname")
	}
	if rec.GetNetwork() != "" && p.GetNetSocket() != "" {
		s.NetdevSocket, s.MAC = p.GetNetSocket(), rec.GetMac()
	}
	switch {
	case img.GetKind() == hypervisorv1.ImageKind_IMAGE_KIND_KERNEL:
		s.Boot = qemu.BootKernel
		s.Kernel, s.Initrd, s.Cmdline = img.GetKernel(), img.GetInitrd(), img.GetCmdline()
	case img.GetKind() == hypervisorv1.ImageKind_IMAGE_KIND_OCI:
		// The boot chain's kernel with the root on its command line; the
		// root and its hash tree read-only, the VM's disk for the overlay.
		s.Boot = qemu.BootKernel
		s.Kernel, s.Initrd, s.Cmdline = img.GetKernel(), img.GetInitrd(), img.GetCmdline()
		s.Volume = p.GetVolume()
		s.ReadOnlyDisks = []qemu.Disk{
			{Path: img.GetOci().GetRoot(), Serial: ociboot.SerialRoot},
			{Path: img.GetOci().GetRootVerity(), Serial: ociboot.SerialVerity},
		}
	case phase == hypervisorv1.Phase_PHASE_INSTALL:
		s.Boot = qemu.BootInstall
		s.UKI, s.Installer, s.Volume = img.GetUki(), img.GetDisk(), p.GetVolume()
		s.Credentials["vm.install-target"] = "/dev/disk/by-id/virtio-" + qemu.DefaultTargetSerial
	default:
		s.Boot = qemu.BootDisk
		s.Volume = p.GetVolume()
		s.FirstBoot = !rec.GetBooted()
	}
	return s
}

// cid picks the VM's vsock CID: the one it had, else the first free one from
// a start that depends on the state directory, so two hypervisors on one host
// rarely collide (QEMU refuses a CID in use, and Launch retries).
func (d *Driver) cid(had uint32, taken func(uint32) bool) uint32 {
	if taken == nil {
		taken = func(uint32) bool { return false }
	}
	if had >= qemu.MinCID && !taken(had) {
		return had
	}
	h := fnv.New32a()
	h.Write([]byte(d.cfg.StateDir))
	cid := qemu.MinCID + h.Sum32()%(1<<20)
	for taken(cid) {
		cid++
	}
	return cid
}
