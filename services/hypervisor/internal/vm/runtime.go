package vm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/guest"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/proc"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/qemu"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/store/storepb"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/swtpm"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// runtime is a VM's live processes and the goroutine watching them.
type runtime struct {
	phase hypervisorv1.Phase
	qemu  *proc.Process
	tpm   *proc.Process
	mon   *qemu.Monitor

	stopping      atomic.Bool // stop, reboot or delete asked for the power-down
	guestShutdown atomic.Bool // QMP SHUTDOWN said the guest powered off or reset
	guestReset    atomic.Bool // QMP SHUTDOWN's reason was guest-reset
	// stopReason, set under the machine's lock before the power-down,
	// becomes lastError of the stopped record (the hypervisor's exit).
	stopReason string

	cancel  context.CancelFunc // ends readiness and the supervisor (detach)
	settled chan struct{}      // closed once the record reflects the exit
}

// consoleTailLines is how much console goes into lastError.
const consoleTailLines = 40

// launch provisions the vTPM, registers an installed boot with attestation,
// starts swtpm, then QEMU, for one phase, and the supervisor. Called with
// the op lock held.
func (m *Manager) launch(mc *machine, phase hypervisorv1.Phase) error {
	rec, _ := mc.snapshot()
	p := rec.GetPaths()
	img, err := m.images.Get(rec.GetImage())
	if err != nil {
		return fmt.Errorf("image %s: %w", rec.GetImage(), err)
	}
	ctx, cancel := context.WithTimeout(m.ctx, 30*time.Second)
	defer cancel()
	identity, err := m.provisionTPM(ctx, rec)
	if err != nil {
		return err
	}
	rec = m.update(mc, func(r *storepb.VirtualMachine) {
		r.Tpm = identity
		if phase == hypervisorv1.Phase_PHASE_BOOT {
			// The gate closes before anything of the new boot runs.
			r.Attestation = &attestationv1.Attestation{Required: r.GetRequireAttestation(), UserDataReleased: !r.GetRequireAttestation()}
		}
	})
	var att *attestationv1.Attestation
	if phase == hypervisorv1.Phase_PHASE_BOOT {
		att = m.beginBoot(rec)
		m.update(mc, func(r *storepb.VirtualMachine) { r.Attestation = att })
	}
	tpm, err := swtpm.Start(ctx, swtpm.Config{Binary: m.cfg.SwtpmBinary, StateDir: p.GetTpmState()})
	if err != nil {
		return err
	}
	spec := m.spec(rec, img, phase)
	if m.cfg.NotifyVsockPort != 0 {
		spec.NotifySocket = ""
		spec.VsockCID = m.allocateCID(mc.id, rec.GetCid())
		spec.Credentials["vmm.notify_socket"] = fmt.Sprintf("vsock-stream:2:%d", m.cfg.NotifyVsockPort)
	}
	args, err := spec.Args()
	if err != nil {
		tpm.Terminate(m.cfg.KillGrace)
		return err
	}
	var (
		qp  *proc.Process
		mon *qemu.Monitor
	)
	for attempt := 0; ; attempt++ {
		qp, mon, err = m.startQEMU(ctx, p, args)
		if err == nil {
			break
		}
		// QEMU refuses a vsock CID another VM on the host holds: take the next.
		if spec.VsockCID == 0 || attempt >= 16 || !strings.Contains(err.Error(), "guest cid") {
			tpm.Terminate(m.cfg.KillGrace)
			return err
		}
		spec.VsockCID++
		if args, err = spec.Args(); err != nil {
			tpm.Terminate(m.cfg.KillGrace)
			return err
		}
	}
	rt := &runtime{phase: phase, qemu: qp, tpm: tpm, mon: mon, settled: make(chan struct{})}
	m.update(mc, func(r *storepb.VirtualMachine) {
		r.Phase = phase
		r.Cid = spec.VsockCID
		r.Accelerator = m.cfg.Accelerator
		r.Processes = &storepb.Processes{
			Qemu: &storepb.Process{Pid: int32(qp.PID), StartTicks: qp.StartTicks},
			Tpm:  &storepb.Process{Pid: int32(tpm.PID), StartTicks: tpm.StartTicks},
		}
		r.Status, r.LastError, r.ReadyAt = "", "", nil
		if phase == hypervisorv1.Phase_PHASE_INSTALL {
			r.State = hypervisorv1.State_STATE_INSTALLING
		} else {
			r.State = hypervisorv1.State_STATE_BOOTING
			r.BootedAt = timestamppb.Now()
			r.BootCount++
		}
		mc.run = rt
	})
	m.supervise(mc, rt)
	return nil
}

// startQEMU starts QEMU and connects QMP; a QEMU that does not come up is
// ended and its log tail returned.
func (m *Manager) startQEMU(ctx context.Context, p *hypervisorv1.Paths, args []string) (*proc.Process, *qemu.Monitor, error) {
	log, err := os.OpenFile(p.GetQemuLog(), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, nil, err
	}
	// The exact argv, as JSON, so a run can be reproduced by hand (make bench does).
	argv, _ := json.Marshal(append([]string{m.cfg.QEMUBinary}, args...))
	fmt.Fprintf(log, "--- %s %s\n", time.Now().UTC().Format(time.RFC3339), argv)
	cmd := exec.Command(m.cfg.QEMUBinary, args...)
	cmd.Stdout, cmd.Stderr = log, log
	qp, err := proc.Start(cmd)
	log.Close() // the child holds its own descriptor
	if err != nil {
		return nil, nil, err
	}
	// Stop waiting for QMP as soon as QEMU exits (a bad argument, a CID in use).
	qctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-qp.Done():
			cancel()
		case <-qctx.Done():
		}
	}()
	mon, err := qemu.Connect(qctx, p.GetQmpSocket())
	if err != nil {
		qp.Terminate(m.cfg.KillGrace)
		return nil, nil, fmt.Errorf("qemu did not come up: %v%s", err, tailFile(p.GetQemuLog(), 10, "\nqemu.log:\n"))
	}
	return qp, mon, nil
}

// spec is the QEMU command of one phase.
func (m *Manager) spec(rec *storepb.VirtualMachine, img *hypervisorv1.Image, phase hypervisorv1.Phase) qemu.Spec {
	p := rec.GetPaths()
	accel := qemu.AccelTCG
	if m.cfg.Accelerator == hypervisorv1.Accelerator_ACCELERATOR_KVM {
		accel = qemu.AccelKVM
	}
	s := qemu.Spec{
		ID:           rec.GetId(),
		QEMUVersion:  m.cfg.QEMUVersion,
		Accel:        accel,
		CPU:          m.cfg.CPU,
		CPUs:         int(rec.GetCpus()),
		MemoryMiB:    int(rec.GetMemoryMib()),
		ConsoleLog:   p.GetConsole(),
		QMPSocket:    p.GetQmpSocket(),
		OVMFCode:     m.cfg.OVMFCode,
		OVMFVars:     p.GetOvmfVars(),
		SwtpmSocket:  tpmSocket(p.GetTpmState()),
		NotifySocket: p.GetNotifySocket(),
		Credentials: map[string]string{
			"system.machine_id":  rec.GetMachineId(),
			"firstboot.hostname": rec.GetHostname(),
		},
	}
	if rec.GetNetwork() != "" && netSocket(rec) != "" {
		s.NetdevSocket, s.MAC = netSocket(rec), rec.GetMac()
	}
	switch {
	case img.GetKind() == hypervisorv1.ImageKind_IMAGE_KIND_KERNEL:
		s.Boot = qemu.BootKernel
		s.Kernel, s.Initrd, s.Cmdline = img.GetKernel(), img.GetInitrd(), img.GetCmdline()
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

// allocateCID picks the VM's vsock CID: the one it had, else the first free
// one from a start that depends on the state directory, so two hypervisors on
// one host rarely collide (QEMU refuses a CID in use, and launch retries).
func (m *Manager) allocateCID(id string, had uint32) uint32 {
	m.mu.Lock()
	defer m.mu.Unlock()
	used := map[uint32]bool{}
	for _, other := range m.machines {
		if other.id == id {
			continue
		}
		other.mu.Lock()
		used[other.rec.GetCid()] = true
		other.mu.Unlock()
	}
	if had >= qemu.MinCID && !used[had] {
		return had
	}
	h := fnv.New32a()
	h.Write([]byte(m.cfg.StateDir))
	cid := qemu.MinCID + h.Sum32()%(1<<20)
	for used[cid] {
		cid++
	}
	return cid
}

// tpmSocket is swtpm's control socket in a VM's tpm/ directory.
func tpmSocket(stateDir string) string {
	return swtpm.Config{StateDir: stateDir}.WithDefaults().CtrlSocket
}

// supervise watches one run: readiness messages, QMP events, the boot
// timeout and the QEMU process, until QEMU exits or the hypervisor detaches.
func (m *Manager) supervise(mc *machine, rt *runtime) {
	ctx, cancel := context.WithCancel(m.ctx)
	rt.cancel = cancel
	rec, _ := mc.snapshot()
	msgs, unsubscribe := m.router.Subscribe(mc.id)
	cid := rec.GetCid()
	if cid != 0 {
		m.router.MapCID(cid, mc.id)
	} else {
		go m.router.AttachSerial(ctx, mc.id, rec.GetPaths().GetNotifySocket())
	}
	if rec.GetNetwork() != "" && netSocket(rec) != "" {
		m.wg.Go(func() { m.attachNIC(ctx, rec) })
	}

	var bootTimer <-chan time.Time
	if rt.phase == hypervisorv1.Phase_PHASE_BOOT && rec.GetReadyAt() == nil && rec.GetState() != hypervisorv1.State_STATE_RUNNING {
		left := m.cfg.BootTimeout - time.Since(rec.GetBootedAt().AsTime())
		bootTimer = time.After(max(left, 0))
	}
	var installTimer <-chan time.Time
	if rt.phase == hypervisorv1.Phase_PHASE_INSTALL {
		installTimer = time.After(m.cfg.InstallTimeout)
	}
	var events <-chan qemu.Event
	if rt.mon != nil {
		events = rt.mon.Events()
	}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		defer unsubscribe()
		if cid != 0 {
			defer m.router.UnmapCID(cid)
		}
		for {
			select {
			case msg := <-msgs:
				m.onNotify(mc, rt, msg.Ready, msg.Status)
			case ev, ok := <-events:
				if !ok {
					events = nil
					continue
				}
				rt.observe(ev)
			case <-bootTimer:
				m.update(mc, func(r *storepb.VirtualMachine) {
					if s := r.GetState(); s == hypervisorv1.State_STATE_BOOTING || s == hypervisorv1.State_STATE_ATTESTING {
						r.State = hypervisorv1.State_STATE_RUNNING
						r.LastError = fmt.Sprintf("no READY=1 within %s; the guest is up but has not reported ready", fmtDuration(m.cfg.BootTimeout))
					}
				})
			case <-installTimer:
				m.log.Warn("installer did not finish in time; killing it", "vm", mc.id)
				rt.qemu.Terminate(m.cfg.KillGrace)
			case <-rt.qemu.Done():
				// The SHUTDOWN event that says why may still be on its way.
				rt.drainEvents(events, time.Second)
				cancel()
				m.exited(mc, rt)
				return
			case <-ctx.Done():
				// Detach: leave the processes running for the next hypervisor.
				if rt.mon != nil {
					_ = rt.mon.Close()
				}
				close(rt.settled)
				return
			}
		}
	}()
}

func (m *Manager) onNotify(mc *machine, rt *runtime, ready bool, status string) {
	if rt.phase != hypervisorv1.Phase_PHASE_BOOT {
		return // only the installed boot reports readiness
	}
	m.update(mc, func(r *storepb.VirtualMachine) {
		if status != "" {
			r.Status = status
		}
		if !ready {
			return
		}
		switch r.GetState() {
		case hypervisorv1.State_STATE_BOOTING, hypervisorv1.State_STATE_ATTESTING, hypervisorv1.State_STATE_RUNNING:
			r.State = hypervisorv1.State_STATE_READY
			r.ReadyAt = timestamppb.Now()
			r.Booted = true
			// READY=1 keeps an attestation rejection: the guest is up, not trusted.
			if !strings.HasPrefix(r.GetLastError(), guest.RejectedPrefix) {
				r.LastError = ""
			}
		}
	})
}

// exited settles the record after QEMU ended, and starts the installed boot
// after a successful installer.
func (m *Manager) exited(mc *machine, rt *runtime) {
	if rt.mon != nil {
		_ = rt.mon.Close()
	}
	rt.tpm.Terminate(m.cfg.KillGrace) // --terminate ends it with QEMU; this reaps a straggler
	code, known := rt.qemu.ExitCode()
	clean := (known && code == 0) || (!known && rt.guestShutdown.Load())
	rec, _ := mc.snapshot()
	m.mu.Lock()
	closing := m.closing
	m.mu.Unlock()
	installNext, bootNext := false, false
	reset := rt.phase == hypervisorv1.Phase_PHASE_BOOT && rt.guestReset.Load() && clean
	resets := 0
	if reset {
		resets = mc.noteReset(time.Now())
	}
	m.update(mc, func(r *storepb.VirtualMachine) {
		r.Processes = nil
		mc.run = nil
		switch {
		case rt.stopping.Load():
			if r.GetState() != hypervisorv1.State_STATE_DELETING {
				r.State = hypervisorv1.State_STATE_STOPPED
				if rt.stopReason != "" {
					r.LastError = rt.stopReason
				}
			}
		case reset && closing:
			r.State = hypervisorv1.State_STATE_STOPPED
			r.LastError = "the guest rebooted while vm-manager shut down; start the VM"
		case reset && resets > MaxGuestResets:
			r.State = hypervisorv1.State_STATE_FAILED
			r.LastError = fmt.Sprintf("the guest reset %d times within %s; it is not booted again (start the VM to try again)", resets, fmtDuration(GuestResetWindow)) +
				tailFile(rec.GetPaths().GetConsole(), consoleTailLines, "\nconsole:\n")
		case reset:
			// A reboot inside the guest: its next boot is a new one, which
			// provisions, registers with attestation and closes the gate
			// before it runs, as reboot_vm does.
			r.State = hypervisorv1.State_STATE_BOOTING
			r.Status, r.ReadyAt = "", nil
			r.Attestation = &attestationv1.Attestation{Required: r.GetRequireAttestation(), UserDataReleased: !r.GetRequireAttestation()}
			bootNext = true
		case rt.phase == hypervisorv1.Phase_PHASE_INSTALL && clean && closing:
			r.InstalledAt = timestamppb.Now()
			r.State = hypervisorv1.State_STATE_STOPPED
			r.LastError = "vm-manager shut down before the installed boot started; start the VM"
		case rt.phase == hypervisorv1.Phase_PHASE_INSTALL && clean:
			r.InstalledAt = timestamppb.Now()
			installNext = true
		case rt.phase == hypervisorv1.Phase_PHASE_INSTALL:
			r.State = hypervisorv1.State_STATE_FAILED
			r.LastError = "installer exited: " + exitText(code, known) + tailFile(rec.GetPaths().GetConsole(), consoleTailLines, "\nconsole:\n")
		case clean:
			r.State = hypervisorv1.State_STATE_STOPPED
			r.LastError = "guest shut down"
		default:
			r.State = hypervisorv1.State_STATE_FAILED
			r.LastError = "qemu exited: " + exitText(code, known) + tailFile(rec.GetPaths().GetConsole(), consoleTailLines, "\nconsole:\n")
		}
	})
	close(rt.settled)
	if bootNext {
		m.log.Info("the guest reset; starting its next boot", "vm", mc.id, "resets_in_window", resets)
		go m.relaunch(mc)
	}
	if installNext {
		go func() {
			mc.op.Lock()
			defer mc.op.Unlock()
			if err := m.launch(mc, hypervisorv1.Phase_PHASE_BOOT); err != nil {
				m.update(mc, func(r *storepb.VirtualMachine) {
					r.State = hypervisorv1.State_STATE_FAILED
					r.LastError = "installed boot did not start: " + err.Error()
				})
			}
		}()
	}
}

func exitText(code int, known bool) string {
	switch {
	case !known:
		return "status unknown (adopted after a hypervisor restart)"
	case code == -1:
		return "killed by a signal"
	default:
		return fmt.Sprintf("exit status %d", code)
	}
}

// tailFile returns the last n lines of a file behind a header, or "".
func tailFile(path string, n int, header string) string {
	t := tail(path, n)
	if t == "" {
		return ""
	}
	return header + t
}

// tail returns the last n lines of a file (without reading all of a huge one).
func tail(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ""
	}
	const maxRead = 4 << 20
	off := max(fi.Size()-maxRead, 0)
	buf := make([]byte, fi.Size()-off)
	if _, err := f.ReadAt(buf, off); err != nil && !errors.Is(err, os.ErrClosed) && len(buf) == 0 {
		return ""
	}
	buf = bytes.TrimRight(buf, "\n")
	lines := bytes.Split(buf, []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	for i, l := range lines {
		lines[i] = bytes.TrimSuffix(l, []byte("\r")) // the serial console ends lines in CRLF
	}
	return string(bytes.Join(lines, []byte("\n")))
}
