// Package bootphase splits the seconds of one launch of an installed boot
// into phases: the host's (vTPM provisioning, the boot's registration with
// attestation, swtpm, QEMU), timed on the host's clock, and the guest's
// (firmware, kernel, vm-agent), read from what the guest wrote on its serial
// console. It is how create→ready is explained (docs/performance.md).
package bootphase

import (
	"regexp"
	"strconv"
	"strings"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"google.golang.org/protobuf/proto"
)

// Processes are when a launch's processes were spawned and first answered,
// on the host's clock (the driver's part of a launch).
type Processes struct {
	SwtpmStarted, SwtpmReady time.Time
	QEMUStarted, QEMUReady   time.Time
}

// Marks are one launch's host times.
type Marks struct {
	Start       time.Time // the launch began
	Provisioned time.Time // the vTPM was provisioned
	Registered  time.Time // attestation knows the boot
	Processes
}

// Host is the phases the host timed itself; nil when a mark is missing.
func Host(m Marks) *hypervisorv1.BootPhases {
	p := m.Processes
	for _, t := range []time.Time{m.Start, m.Provisioned, m.Registered, p.SwtpmStarted, p.SwtpmReady, p.QEMUStarted, p.QEMUReady} {
		if t.IsZero() {
			return nil
		}
	}
	return &hypervisorv1.BootPhases{
		ProvisionSeconds: secs(m.Provisioned.Sub(m.Start)),
		RegisterSeconds:  secs(m.Registered.Sub(m.Provisioned)),
		SwtpmSeconds:     secs(p.SwtpmReady.Sub(p.SwtpmStarted)),
		QemuSeconds:      secs(p.QEMUReady.Sub(p.QEMUStarted)),
	}
}

// Guest is the guest's own account of its boot, in seconds since its
// kernel started: the kernel's printk time of "Run /init as init process"
// and the uptime vm-agent prints with its ready line.
type Guest struct {
	Init, Ready float64
	HasInit     bool
}

var (
	// The kernel's line as printk writes it with CONFIG_PRINTK_TIME.
	initRE = regexp.MustCompile(`^\[\s*([0-9]+\.[0-9]+)\] Run /init as init process`)
	// vm-agent's (guest/internal/agent): "vm-agent: ready (2.31s after kernel start)",
	// as PID 1 writes it, or under systemd with the journal's console prefix
	// ("[  143.69] vm-agent[756]: vm-agent: ready (…)", vm-base).
	readyRE = regexp.MustCompile(`^(?:\[\s*[0-9]+\.[0-9]+\] vm-agent\[[0-9]+\]: )?vm-agent: ready \(([0-9]+(?:\.[0-9]+)?)s after kernel start\)`)
)

// ParseConsole reads the last boot's Guest from the end of a serial
// console: the last ready line, and the last /init line before it. ok is
// false without a ready line (a guest that is not vm-agent, a console that
// was cut).
func ParseConsole(console string) (g Guest, ok bool) {
	lines := strings.Split(console, "\n")
	readyAt := -1
	for i := len(lines) - 1; i >= 0; i-- {
		if m := readyRE.FindStringSubmatch(strings.TrimSuffix(lines[i], "\r")); m != nil {
			v, err := strconv.ParseFloat(m[1], 64)
			if err != nil {
				return Guest{}, false
			}
			g.Ready, readyAt = v, i
			break
		}
	}
	if readyAt < 0 {
		return Guest{}, false
	}
	for i := readyAt - 1; i >= 0; i-- {
		l := strings.TrimSuffix(lines[i], "\r")
		if readyRE.MatchString(l) {
			break // an earlier boot's
		}
		if m := initRE.FindStringSubmatch(l); m != nil {
			if v, err := strconv.ParseFloat(m[1], 64); err == nil && v <= g.Ready {
				g.Init, g.HasInit = v, true
			}
			break
		}
	}
	return g, true
}

// WithGuest completes host's phases with the guest's, once READY=1 arrived
// at readyAt: the kernel started readyAt minus the guest's uptime then. A
// guest account that puts the kernel's start before QMP answered (a clock
// that does not follow the host's) adds no guest phases. start and
// qemuReady are the launch's marks.
func WithGuest(host *hypervisorv1.BootPhases, g Guest, start, qemuReady, readyAt time.Time) *hypervisorv1.BootPhases {
	out := proto.CloneOf(host)
	out.TotalSeconds = proto.Float64(secs(readyAt.Sub(start)))
	kernelStart := readyAt.Add(-time.Duration(g.Ready * float64(time.Second)))
	fw := kernelStart.Sub(qemuReady)
	if fw < 0 || g.Ready < 0 {
		return out
	}
	out.FirmwareSeconds = proto.Float64(secs(fw))
	if g.HasInit {
		out.KernelSeconds = proto.Float64(g.Init)
		out.AgentSeconds = proto.Float64(g.Ready - g.Init)
	}
	return out
}

// secs rounds to milliseconds: the clocks compared here are no finer.
func secs(d time.Duration) float64 { return float64(d.Round(time.Millisecond)) / float64(time.Second) }
