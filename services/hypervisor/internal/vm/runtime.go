package vm

import (
	"context"
	"fmt"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/network"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/notify"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/gate"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/bootphase"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/guestapi"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/logtail"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Runner runs VMs over a Driver: it provisions the vTPM, registers each boot
// with attestation, launches, supervises every run until it ends (readiness,
// timers, the exit), and re-adopts the runs a previous hypervisor left.
type Runner struct {
	cfg      Config
	log      *slog.Logger
	table    *Table
	driver   Driver
	images   ImageResolver
	verifier attestationv1.VerifierServiceClient
	router   *notify.Router
	nets     *network.Registry
	activity *Activity
	boots    *Boots

	ctx    context.Context // ends at detach: the runs are left to the next hypervisor
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// RunnerDeps are what a Runner works with.
type RunnerDeps struct {
	Table    *Table
	Driver   Driver
	Images   ImageResolver
	Verifier attestationv1.VerifierServiceClient // nil: no attestation service
	Router   *notify.Router
	Networks *network.Registry
	Activity *Activity
	Boots    *Boots
}

// NewRunner runs nothing until a launch or a restore.
func NewRunner(cfg Config, log *slog.Logger, d RunnerDeps) *Runner {
	cfg.defaults()
	ctx, cancel := context.WithCancel(context.Background())
	return &Runner{cfg: cfg, log: log, table: d.Table, driver: d.Driver, images: d.Images, verifier: d.Verifier, router: d.Router,
		nets: d.Networks, activity: d.Activity, boots: d.Boots, ctx: ctx, cancel: cancel}
}

// detach stops supervising: the processes keep running.
func (rn *Runner) detach() {
	rn.cancel()
	rn.wg.Wait()
}

// runtime is a VM's live run and the goroutine watching it.
type runtime struct {
	phase hypervisorv1.Phase
	proc  Run

	stopping      atomic.Bool // stop, reboot or delete asked for the power-down
	guestShutdown atomic.Bool // the guest powered off or reset
	guestReset    atomic.Bool // the guest reset
	suspending    atomic.Bool // a suspend is saving the VM (suspend.go)
	// stopReason, set under the machine's lock before the power-down,
	// becomes lastError of the stopped record (the hypervisor's exit).
	stopReason string

	cancel  context.CancelFunc // ends readiness and the supervisor (detach)
	settled chan struct{}      // closed once the record reflects the exit

	// marks time an installed boot's launch (zero for adopted runs): its
	// phases go into the record at launch and at READY=1.
	marks bootphase.Marks
}

// launchTimed is a Run that knows when its processes started and answered
// (the driver's launches; not adoptions).
type launchTimed interface{ Launched() bootphase.Processes }

// consoleTailLines is how much console goes into lastError.
const consoleTailLines = 40

// consolePhaseLines is how much console the boot phases are looked for in:
// a verbose kernel's boot and vm-agent's lines, with room to spare.
const consolePhaseLines = 4000

// launch provisions the vTPM, registers an installed boot with attestation,
// starts swtpm, then QEMU, for one phase, and the supervisor. Called with
// the op lock held.
func (rn *Runner) launch(mc *machine, phase hypervisorv1.Phase) error {
	return rn.start(mc, phase, rn.provisionTPM, rn.driver.Launch)
}

// start is launch with the vTPM's keys from identity and the processes
// from run: the driver's provisioning and Launch, or a fork's (fork.go).
func (rn *Runner) start(mc *machine, phase hypervisorv1.Phase, identity func(context.Context, *storepb.VirtualMachine) (*storepb.TpmKeys, error), run func(context.Context, Launch) (Run, error)) error {
	rec, _ := mc.snapshot()
	img, err := rn.images.Get(rec.GetImage())
	if err != nil {
		return fmt.Errorf("image %s: %w", rec.GetImage(), err)
	}
	ctx, cancel := context.WithTimeout(rn.ctx, 30*time.Second)
	defer cancel()
	ctx, span := rn.startLaunch(ctx, mc, phase)
	defer span.End()
	marks := bootphase.Marks{Start: time.Now()}
	keys, err := identity(ctx, rec)
	if err != nil {
		return err
	}
	marks.Provisioned = time.Now()
	rec = rn.table.update(mc, func(r *storepb.VirtualMachine) {
		r.Tpm = keys
		if phase == hypervisorv1.Phase_PHASE_BOOT {
			// The gate closes before anything of the new boot runs.
			r.Attestation = gate.NewBoot(r.GetRequireAttestation())
		}
	})
	var att *attestationv1.Attestation
	if phase == hypervisorv1.Phase_PHASE_BOOT {
		att = rn.beginBoot(ctx, rec)
		rn.table.update(mc, func(r *storepb.VirtualMachine) { r.Attestation = att })
	}
	marks.Registered = time.Now()
	proc, err := run(ctx, Launch{Record: rec, Image: img, Phase: phase, CIDTaken: rn.table.cidTaken(mc.id)})
	if err != nil {
		return err
	}
	rt := &runtime{phase: phase, proc: proc, settled: make(chan struct{})}
	var phases *hypervisorv1.BootPhases
	if t, ok := proc.(launchTimed); ok && phase == hypervisorv1.Phase_PHASE_BOOT {
		marks.Processes = t.Launched()
		if phases = bootphase.Host(marks); phases != nil {
			rt.marks = marks
		}
	}
	rn.table.update(mc, func(r *storepb.VirtualMachine) {
		r.Phase = phase
		r.Cid = proc.CID()
		r.Accelerator = rn.cfg.Accelerator
		r.Processes = proc.Processes()
		r.Status, r.LastError, r.ReadyAt = "", "", nil
		if phase == hypervisorv1.Phase_PHASE_INSTALL {
			r.State = hypervisorv1.State_STATE_INSTALLING
		} else {
			r.State = hypervisorv1.State_STATE_BOOTING
			r.BootedAt = timestamppb.Now()
			r.BootCount++
			r.BootPhases = phases
		}
		mc.run = rt
	})
	rn.supervise(mc, rt)
	rn.activity.touch(mc, ActivityStart)
	return nil
}

// cidTaken says whether a VM other than id holds a vsock CID.
func (tb *Table) cidTaken(id string) func(uint32) bool {
	tb.mu.Lock()
	used := map[uint32]bool{}
	for _, other := range tb.machines {
		if other.id == id {
			continue
		}
		other.mu.Lock()
		used[other.rec.GetCid()] = true
		other.mu.Unlock()
	}
	tb.mu.Unlock()
	return func(cid uint32) bool { return used[cid] }
}

// supervise watches one run: readiness messages, QMP events, the boot
// timeout and the QEMU process, until QEMU exits or the hypervisor detaches.
func (rn *Runner) supervise(mc *machine, rt *runtime) {
	ctx, cancel := context.WithCancel(rn.ctx)
	rt.cancel = cancel
	rec, _ := mc.snapshot()
	msgs, unsubscribe := rn.router.Subscribe(mc.id)
	cid := rec.GetCid()
	if cid != 0 {
		rn.router.MapCID(cid, mc.id)
	} else {
		go rn.router.AttachSerial(ctx, mc.id, rec.GetPaths().GetNotifySocket())
	}
	if rec.GetNetwork() != "" && netSocket(rec) != "" {
		rn.wg.Go(func() { rn.attachNIC(ctx, rec) })
	}

	var bootTimer <-chan time.Time
	if rt.phase == hypervisorv1.Phase_PHASE_BOOT && rec.GetReadyAt() == nil && rec.GetState() != hypervisorv1.State_STATE_RUNNING {
		// A claimed pool member's boot carries on from its claim.
		since := rec.GetBootedAt().AsTime()
		if c := rec.GetClaimedAt(); c != nil && c.AsTime().After(since) {
			since = c.AsTime()
		}
		left := rn.cfg.BootTimeout - time.Since(since)
		bootTimer = time.After(max(left, 0))
	}
	var installTimer <-chan time.Time
	if rt.phase == hypervisorv1.Phase_PHASE_INSTALL {
		installTimer = time.After(rn.cfg.InstallTimeout)
	}
	events := rt.proc.Shutdowns()
	rn.wg.Add(1)
	go func() {
		defer rn.wg.Done()
		defer unsubscribe()
		if cid != 0 {
			defer rn.router.UnmapCID(cid)
		}
		for {
			select {
			case msg := <-msgs:
				rn.onNotify(mc, rt, msg.Ready, msg.Status)
			case ev, ok := <-events:
				if !ok {
					events = nil
					continue
				}
				rt.observe(ev)
			case <-bootTimer:
				rn.table.update(mc, func(r *storepb.VirtualMachine) {
					if s := r.GetState(); s == hypervisorv1.State_STATE_BOOTING || s == hypervisorv1.State_STATE_ATTESTING {
						r.State = hypervisorv1.State_STATE_RUNNING
						r.LastError = fmt.Sprintf("no READY=1 within %s; the guest is up but has not reported ready", fmtDuration(rn.cfg.BootTimeout))
					}
				})
			case <-installTimer:
				rn.log.Warn("installer did not finish in time; killing it", "vm", mc.id)
				rt.proc.Terminate(rn.cfg.KillGrace)
			case <-rt.proc.Done():
				// The SHUTDOWN event that says why may still be on its way
				// (a suspend's quit needs no reason).
				if !rt.suspending.Load() {
					rt.drainEvents(events, time.Second)
				}
				cancel()
				rn.exited(mc, rt)
				return
			case <-ctx.Done():
				// Detach: leave the processes running for the next hypervisor.
				rt.proc.Detach()
				close(rt.settled)
				return
			}
		}
	}()
}

func (rn *Runner) onNotify(mc *machine, rt *runtime, ready bool, status string) {
	if rt.phase != hypervisorv1.Phase_PHASE_BOOT {
		return // only the installed boot reports readiness
	}
	now := time.Now()
	var guestPhases *bootphase.Guest
	if rec, _ := mc.snapshot(); ready && rec.GetReadyAt() == nil && !rt.marks.Start.IsZero() {
		// The guest printed its ready line before it sent READY=1.
		if g, ok := bootphase.ParseConsole(logtail.Lines(rec.GetPaths().GetConsole(), consolePhaseLines)); ok {
			guestPhases = &g
		}
	}
	rn.table.update(mc, func(r *storepb.VirtualMachine) {
		if status != "" {
			r.Status = status
		}
		if !ready {
			return
		}
		switch r.GetState() {
		case hypervisorv1.State_STATE_BOOTING, hypervisorv1.State_STATE_ATTESTING, hypervisorv1.State_STATE_RUNNING:
			r.State = hypervisorv1.State_STATE_READY
			r.ReadyAt = timestamppb.New(now)
			r.Booted = true
			if r.GetBootPhases() != nil {
				var g bootphase.Guest
				if guestPhases != nil {
					g = *guestPhases
				} else {
					g.Ready = -1 // no guest phases, only the total
				}
				r.BootPhases = bootphase.WithGuest(r.GetBootPhases(), g, rt.marks.Start, rt.marks.QEMUReady, now)
			}
			// READY=1 keeps an attestation rejection: the guest is up, not trusted.
			if !strings.HasPrefix(r.GetLastError(), guestapi.RejectedPrefix) {
				r.LastError = ""
			}
		}
	})
}

// verifyInstall compares the volume an installer powered off after with
// the image it installed (the driver reads both).
func (rn *Runner) verifyInstall(rec *storepb.VirtualMachine) error {
	img, err := rn.images.Get(rec.GetImage())
	if err != nil {
		return fmt.Errorf("its image %s left the catalog during the install", rec.GetImage())
	}
	start := time.Now()
	if err := rn.driver.VerifyInstall(rec, img); err != nil {
		return err
	}
	rn.log.Info("install verified", "vm", rec.GetId(), "image", rec.GetImage(), "seconds", time.Since(start).Seconds())
	return nil
}

// exited settles the record after QEMU ended, and starts the installed boot
// after a successful installer.
func (rn *Runner) exited(mc *machine, rt *runtime) {
	rt.proc.Reap()
	code, known := rt.proc.ExitCode()
	clean := (known && code == 0) || (!known && rt.guestShutdown.Load())
	rec, _ := mc.snapshot()
	closing := rn.table.isClosing()
	installNext, bootNext := false, false
	reset := rt.phase == hypervisorv1.Phase_PHASE_BOOT && rt.guestReset.Load() && clean
	resets := 0
	if reset {
		resets = mc.noteReset(time.Now())
	}
	suspended := rt.suspending.Load() && rn.savedState(rec) == nil
	// An installer resets the machine when it fails (and a guest kernel that
	// panics does too): under -no-reboot QEMU then exits 0, but nothing was
	// installed.
	installReset := rt.phase == hypervisorv1.Phase_PHASE_INSTALL && rt.guestReset.Load()
	var installErr error
	if rt.phase == hypervisorv1.Phase_PHASE_INSTALL && clean && !installReset && !rt.stopping.Load() && !rt.suspending.Load() {
		installErr = rn.verifyInstall(rec)
	}
	rn.table.update(mc, func(r *storepb.VirtualMachine) {
		r.Processes = nil
		mc.run = nil
		switch {
		case suspended:
			r.State = hypervisorv1.State_STATE_SUSPENDED
			r.SuspendedAt = timestamppb.Now()
		case rt.suspending.Load():
			r.State = hypervisorv1.State_STATE_FAILED
			r.LastError = "qemu exited during a suspend, before the state was saved: " + exitText(code, known) +
				logtail.WithHeader(rec.GetPaths().GetConsole(), consoleTailLines, "\nconsole:\n")
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
				logtail.WithHeader(rec.GetPaths().GetConsole(), consoleTailLines, "\nconsole:\n")
		case reset:
			// A reboot inside the guest: its next boot is a new one, which
			// provisions, registers with attestation and closes the gate
			// before it runs, as reboot_vm does.
			r.State = hypervisorv1.State_STATE_BOOTING
			r.Status, r.ReadyAt = "", nil
			r.Attestation = gate.NewBoot(r.GetRequireAttestation())
			bootNext = true
		case installReset:
			r.State = hypervisorv1.State_STATE_FAILED
			r.LastError = "the installer failed: it reset the machine" +
				logtail.WithHeader(rec.GetPaths().GetConsole(), consoleTailLines, "\nconsole:\n")
		case rt.phase == hypervisorv1.Phase_PHASE_INSTALL && clean && installErr != nil:
			r.State = hypervisorv1.State_STATE_FAILED
			r.LastError = "the install does not verify: " + installErr.Error() +
				logtail.WithHeader(rec.GetPaths().GetConsole(), consoleTailLines, "\nconsole:\n")
		case rt.phase == hypervisorv1.Phase_PHASE_INSTALL && clean && closing:
			r.InstalledAt = timestamppb.Now()
			r.State = hypervisorv1.State_STATE_STOPPED
			r.LastError = "vm-manager shut down before the installed boot started; start the VM"
		case rt.phase == hypervisorv1.Phase_PHASE_INSTALL && clean:
			r.InstalledAt = timestamppb.Now()
			installNext = true
		case rt.phase == hypervisorv1.Phase_PHASE_INSTALL:
			r.State = hypervisorv1.State_STATE_FAILED
			r.LastError = "installer exited: " + exitText(code, known) + logtail.WithHeader(rec.GetPaths().GetConsole(), consoleTailLines, "\nconsole:\n")
		case clean && rt.phase == hypervisorv1.Phase_PHASE_BOOT && rec.GetReadyAt() == nil:
			// A boot that gave up (an OS whose initrd powers off on a failure,
			// dm-verity refusing a block): the console says why.
			r.State = hypervisorv1.State_STATE_STOPPED
			r.LastError = "the guest powered off before it was ready" +
				logtail.WithHeader(rec.GetPaths().GetConsole(), consoleTailLines, "\nconsole:\n")
		case clean:
			r.State = hypervisorv1.State_STATE_STOPPED
			r.LastError = "guest shut down"
		default:
			r.State = hypervisorv1.State_STATE_FAILED
			r.LastError = "qemu exited: " + exitText(code, known) + logtail.WithHeader(rec.GetPaths().GetConsole(), consoleTailLines, "\nconsole:\n")
		}
	})
	close(rt.settled)
	if bootNext {
		rn.log.Info("the guest reset; starting its next boot", "vm", mc.id, "resets_in_window", resets)
		go rn.relaunch(mc)
	}
	if installNext {
		go func() {
			mc.op.Lock()
			defer mc.op.Unlock()
			if err := rn.launch(mc, hypervisorv1.Phase_PHASE_BOOT); err != nil {
				rn.table.update(mc, func(r *storepb.VirtualMachine) {
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
