package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/giantswarm/vm-manager/guest/internal/imdsclient"
	"github.com/giantswarm/vm-manager/guest/internal/initsys"
	"github.com/giantswarm/vm-manager/guest/internal/installer"
	"github.com/giantswarm/vm-manager/guest/internal/netcfg"
	"github.com/giantswarm/vm-manager/guest/internal/sdnotify"
	"github.com/giantswarm/vm-manager/guest/internal/smbios"
	"github.com/giantswarm/vm-manager/guest/internal/sshd"
	"github.com/giantswarm/vm-manager/guest/internal/version"
)

// Credential names (vm-manager contract §4.1).
const (
	CredHostname     = "firstboot.hostname"
	CredMachineID    = "system.machine_id"
	CredNotifySocket = "vmm.notify_socket"
)

// RunInit is the PID 1 entry point. It never returns: the machine powers off at the
// end, also after a fatal error, so a broken guest ends instead of hanging. An
// install that fails resets the machine instead, which the host reads as failure.
func RunInit(con *Console) {
	installing := false
	fail := func(msg string) {
		if installing {
			con.Printf("installer failed: %s", msg)
			con.Printf("resetting")
			resetMachine(con)
		}
		con.Printf("fatal: %s", msg)
		con.Printf("powering off")
		powerOff(con)
	}
	defer func() {
		if r := recover(); r != nil {
			fail(fmt.Sprintf("panic: %v\n%s", r, debug.Stack()))
		}
	}()
	if err := boot(con, &installing); err != nil {
		fail(err.Error())
	}
	powerOff(con)
}

func powerOff(con *Console) {
	err := initsys.PowerOff()
	con.Printf("power off failed: %v", err)
	os.Exit(1) // PID 1 exiting panics the kernel; panic=-1 then ends the VM too
}

// boot is the whole boot; it sets *installing once it knows this is the
// install phase, so that a failure from then on resets the machine.
func boot(con *Console, installing *bool) error {
	con.Printf("starting, version %s", version.Version)
	warnings, err := initsys.MountAll(initsys.Mounts)
	for _, w := range warnings {
		con.Printf("warning: %v", w)
	}
	if err != nil {
		return err
	}
	ensureConsole()
	if err := initsys.CtrlAltDelToSignal(); err != nil {
		con.Printf("warning: ctrl-alt-del: %v", err)
	}
	ctx := context.Background()
	go initsys.ReapZombies(ctx)
	stop := initsys.TermSignals()

	creds, errs := smbios.ReadCredentials(smbios.DefaultEntriesDir)
	for _, e := range errs {
		con.Printf("warning: credentials: %v", e)
	}
	con.Printf("credentials: %s", credNames(creds))
	// The install phase is known before anything can fail in it: the SMBIOS
	// entries need only sysfs.
	target, isInstall := creds[installer.Credential]
	*installing = isInstall

	q := newQueue(con)
	q.Send("STATUS=loading kernel modules")
	loaded, err := initsys.LoadModules("/lib/modules")
	if err != nil {
		return fmt.Errorf("loading modules (loaded: %s): %w", strings.Join(loaded, " "), err)
	}
	con.Printf("modules loaded: %s", strings.Join(loaded, " "))

	if *installing {
		// The installer and nothing else: no network, no IMDS, no phases.
		return install(con, string(target), diskWait)
	}
	ph := detectPhases(con)
	// Before the network: the initrd-stage quote must cover its PCR 15.
	oci := mountOCI(con)

	q.Send("STATUS=configuring")
	credHostname := false
	if h := string(creds[CredHostname]); h != "" {
		if err := initsys.SetHostname(h); err != nil {
			con.Printf("warning: hostname: %v", err)
		} else {
			con.Printf("hostname %s", h)
			credHostname = true
		}
	} else {
		con.Printf("no %s credential, hostname from the IMDS if there is one", CredHostname)
	}
	if id, src, err := machineID(creds); err != nil {
		con.Printf("warning: machine-id: %v", err)
	} else if err := initsys.WriteMachineID("/etc/machine-id", id); err != nil {
		con.Printf("warning: machine-id: %v", err)
	} else {
		con.Printf("machine-id %s (from %s)", id, src)
	}

	var sshServer atomic.Pointer[sshd.Server]
	host := &hostListener{con: con, q: q, sshd: sshServer.Load, forks: make(chan map[string]string, 1)}
	go q.run(func() (sdnotify.Sender, error) {
		s, err := sdnotify.Select(ctx, sdnotify.DefaultPaths, portWait(), string(creds[CredNotifySocket]))
		if ser, ok := s.(*sdnotify.Serial); ok && err == nil {
			go host.receive(ser) // a fork learns it here (fork.go)
		}
		return s, err
	})

	pressed := make(chan struct{}, 1)
	go initsys.WatchPowerButton(ctx, "/dev/input/event*", 2*time.Second, func(string) { pressed <- struct{}{} })

	// Network and IMDS: a VM without a NIC (or without a DHCP answer) still becomes
	// ready, it just gets nothing from the IMDS.
	q.Send("STATUS=configuring network")
	lease := configureNetwork(ctx, con)
	host.lease.Store(lease)
	oci.start(con, lease)
	attested := bootResults{initrd: attestSkipped, ready: attestSkipped}
	if lease != nil {
		// Before provisioning: the host may connect as soon as its key is in
		// authorized_keys.
		sshServer.Store(startSSHD(con, oci.command()))
		q.Send("STATUS=provisioning from the IMDS")
		attestOff := cmdlineValue("/proc/cmdline", "vm-agent.attest") == "off"
		attested = newBootProvisioner(con, credHostname, attestOff, ph).run(ctx)
	} else {
		// No IMDS, but the phase path still ends at ready, as the PCR 11 of a
		// VM that reaches readiness must.
		offlinePhases(ph)
	}

	oci.waitStarted(con)
	// The console line first: a host that reads the console once READY=1 arrives
	// must find it there.
	con.Printf("ready (%s after kernel start)", uptime())
	q.Send("READY=1", "STATUS=ready")
	if lease != nil {
		go uploadReports(ctx, con, imdsclient.New(imdsclient.DefaultURL), "/proc", attested, ReportInterval)
	}

	// vm-agent.poweroff-after-ready=<duration> makes a one-shot guest (smoke
	// tests, benchmarks): it powers itself off once the host has its READY=1.
	var oneShot <-chan time.Time
	if d, ok := cmdlineDuration("/proc/cmdline", "vm-agent.poweroff-after-ready"); ok {
		select {
		case <-q.ready:
		case <-time.After(time.Minute):
			con.Printf("READY=1 not delivered within a minute")
		}
		oneShot = time.After(d)
	}

	select {
	case <-oneShot:
		con.Printf("one-shot guest, powering off")
	case <-pressed:
		con.Printf("power button, powering off")
	case s := <-stop:
		con.Printf("%v, powering off", s)
	}
	oci.stop(con)
	return nil
}

// configureNetwork runs DHCP on the first NIC; nil when there is no network.
func configureNetwork(ctx context.Context, con *Console) *netcfg.Lease {
	start := time.Now()
	lease, err := netcfg.Configure(ctx, netcfg.Options{Logf: con.Printf})
	switch {
	case errors.Is(err, netcfg.ErrNoInterface):
		con.Printf("warning: no network interface; continuing without network")
		return nil
	case err != nil:
		con.Printf("warning: network: %v; continuing without network", err)
		return nil
	}
	con.Printf("dhcp %s", lease)
	con.Printf("network: %s in %.2fs, imds %s %s", lease.Interface, time.Since(start).Seconds(), netcfg.IMDSAddr, lease.IMDSRoute)
	return lease
}

// cmdlineValue reads key=<value> from the kernel command line ("" when absent).
func cmdlineValue(path, key string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	for _, f := range strings.Fields(string(b)) {
		if v, ok := strings.CutPrefix(f, key+"="); ok {
			return v
		}
	}
	return ""
}

// cmdlineDuration reads key=<duration> from the kernel command line.
func cmdlineDuration(path, key string) (time.Duration, bool) {
	v := cmdlineValue(path, key)
	if v == "" {
		return 0, false
	}
	d, err := time.ParseDuration(v)
	return d, err == nil
}

// portWait is how long to wait for the notify port to show up: ports arrive
// asynchronously after virtio_console binds, but only if there is a device at all.
func portWait() time.Duration {
	if devs, _ := filepath.Glob("/sys/bus/virtio/drivers/virtio_console/virtio*"); len(devs) > 0 {
		return 5 * time.Second
	}
	return 0
}

// machineID prefers the credential, then the SMBIOS system UUID as systemd does in VMs.
func machineID(creds map[string][]byte) (id, source string, err error) {
	if v, ok := creds[CredMachineID]; ok {
		id, err := initsys.NormalizeMachineID(string(v))
		return id, "credential", err
	}
	b, err := os.ReadFile("/sys/class/dmi/id/product_uuid")
	if err != nil {
		return "", "", errors.New("no credential and no SMBIOS UUID")
	}
	id, err = initsys.NormalizeMachineID(string(b))
	return id, "SMBIOS UUID", err
}

func credNames(creds map[string][]byte) string {
	if len(creds) == 0 {
		return "none"
	}
	names := make([]string, 0, len(creds))
	for n := range creds {
		names = append(names, n) // values may be secret: names only
	}
	sort.Strings(names)
	return strings.Join(names, " ")
}

func uptime() string {
	b, err := os.ReadFile("/proc/uptime")
	if err != nil {
		return "?"
	}
	f, _, _ := strings.Cut(string(b), " ")
	if s, err := strconv.ParseFloat(f, 64); err == nil {
		return fmt.Sprintf("%.2fs", s)
	}
	return "?"
}

// ensureConsole reopens /dev/console as stdin/stdout/stderr when the kernel could not
// hand it to init (no /dev/console in the initramfs).
func ensureConsole() {
	var st unix.Stat_t
	if unix.Fstat(1, &st) == nil {
		return
	}
	fd, err := unix.Open("/dev/console", unix.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		return
	}
	for _, target := range []int{0, 1, 2} {
		_ = unix.Dup2(fd, target)
	}
	if fd > 2 {
		unix.Close(fd)
	}
}
