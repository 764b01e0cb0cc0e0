package bootphase

import (
	"testing"
	"time"
)

// Two boots of the test guest as its console keeps them (CRLF, OVMF's
// screen clearing first), cut to the lines that matter and a few others.
const console = "\x1b[2J\x1b[01;01HEFI stub: Loaded initrd from LINUX_EFI_INITRD_MEDIA_GUID device path\r\n" +
	"[    0.000000] Linux version 6.1.0-57-cloud-amd64 (debian-kernel@lists.debian.org)\r\n" +
	"[    3.906394] Run /init as init process\r\n" +
	"vm-agent: starting, version 0.1.0\n" +
	"vm-agent: ready (5.27s after kernel start)\n" +
	"vm-agent: READY=1 delivered\n" +
	"[    0.000000] Linux version 6.1.0-57-cloud-amd64 (debian-kernel@lists.debian.org)\r\n" +
	"[    2.211907] Run /init as init process\r\n" +
	"vm-agent: starting, version 0.1.0\n" +
	"vm-agent: ready (3.50s after kernel start)\n" +
	"vm-agent: READY=1 delivered\n"

func TestParseConsoleTakesTheLastBoot(t *testing.T) {
	g, ok := ParseConsole(console)
	if !ok || !g.HasInit || g.Init != 2.211907 || g.Ready != 3.5 {
		t.Fatalf("got %+v, %v; want init 2.211907, ready 3.5", g, ok)
	}
}

func TestParseConsoleWithoutInitLine(t *testing.T) {
	// A quiet kernel prints no "Run /init": the earlier boot's must not count.
	c := "[    3.906394] Run /init as init process\r\nvm-agent: ready (5.27s after kernel start)\n" +
		"vm-agent: starting, version 0.1.0\nvm-agent: ready (1.25s after kernel start)\n"
	g, ok := ParseConsole(c)
	if !ok || g.HasInit || g.Ready != 1.25 {
		t.Fatalf("got %+v, %v; want ready 1.25 without init", g, ok)
	}
}

func TestParseConsoleWithoutReadyLine(t *testing.T) {
	for _, c := range []string{"", "[    2.211907] Run /init as init process\r\nvm-agent: starting\n", "vm-agent: ready (?s after kernel start)\n"} {
		if g, ok := ParseConsole(c); ok {
			t.Errorf("%q: got %+v, want nothing", c, g)
		}
	}
}

func TestPhases(t *testing.T) {
	t0 := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	m := Marks{Start: t0, Provisioned: at(400), Registered: at(410),
		Processes: Processes{SwtpmStarted: at(410), SwtpmReady: at(450), QEMUStarted: at(450), QEMUReady: at(700)}}
	host := Host(m)
	if host.GetProvisionSeconds() != 0.4 || host.GetRegisterSeconds() != 0.01 || host.GetSwtpmSeconds() != 0.04 || host.GetQemuSeconds() != 0.25 {
		t.Fatalf("host phases %v", host)
	}
	if host.FirmwareSeconds != nil || host.TotalSeconds != nil {
		t.Fatalf("guest phases before READY=1: %v", host)
	}
	// READY=1 at 9.7 s; the guest's uptime then 5 s: its kernel started at 4.7 s.
	got := WithGuest(host, Guest{Init: 2, Ready: 5, HasInit: true}, m.Start, m.QEMUReady, at(9700))
	if got.GetFirmwareSeconds() != 4 || got.GetKernelSeconds() != 2 || got.GetAgentSeconds() != 3 || got.GetTotalSeconds() != 9.7 {
		t.Fatalf("phases %v", got)
	}
	if host.TotalSeconds != nil {
		t.Fatal("WithGuest changed its argument")
	}
	// A guest clock that says its kernel started before QEMU ran: no guest phases.
	got = WithGuest(host, Guest{Init: 2, Ready: 50, HasInit: true}, m.Start, m.QEMUReady, at(9700))
	if got.FirmwareSeconds != nil || got.KernelSeconds != nil || got.GetTotalSeconds() != 9.7 {
		t.Fatalf("phases %v", got)
	}
	if Host(Marks{Start: t0}) != nil {
		t.Fatal("phases without the driver's marks")
	}
}

// vm-base: systemd forwards vm-agent's lines to the console with the
// journal's prefix; the kernel's /init line is the initrd's.
func TestParseConsoleUnderSystemd(t *testing.T) {
	c := "[    5.503214] Run /init as init process\n" +
		"[    6.026952] systemd[1]: systemd 257.13-1~deb13u1 running in system mode\n" +
		"[  143.697197] vm-agent[756]: vm-agent: ready (143.69s after kernel start)\n"
	g, ok := ParseConsole(c)
	if !ok || !g.HasInit || g.Init != 5.503214 || g.Ready != 143.69 {
		t.Fatalf("got %+v, %v; want init 5.503214, ready 143.69", g, ok)
	}
}
