package agent

import (
	"os"
	"time"

	"github.com/giantswarm/vm-manager/guest/internal/initsys"
	"github.com/giantswarm/vm-manager/guest/internal/installer"
)

// diskWait bounds the wait for the installer's disks to appear: PID 1 of the
// test guest loads virtio_blk itself; under systemd (InstallDiskWait) udev
// loads it, and the unit cannot wait on the disks' device units, which its
// Wants= would pull into every boot.
const (
	diskWait        = 10 * time.Second
	InstallDiskWait = 90 * time.Second
)

// install is the whole install phase. An error means the machine must
// reset, not power off: the host reads a power-off as a finished install.
func install(con *Console, target string, wait time.Duration) error {
	start := time.Now()
	con.Printf("installer: %s=%s", installer.Credential, target)
	r, err := installer.Run(installer.Config{Target: target, Wait: wait, Logf: con.Printf})
	if err != nil {
		return err
	}
	con.Printf("installer: done: %s -> %s, %d bytes, %.2fs in all (%s after kernel start); powering off",
		r.Source, r.Target, r.SourceSize, time.Since(start).Seconds(), uptime())
	return nil
}

// resetMachine ends an install that failed. With -no-reboot, QEMU exits
// with SHUTDOWN reason guest-reset.
func resetMachine(con *Console) {
	err := initsys.Reset()
	con.Printf("reset failed: %v", err)
	os.Exit(1) // PID 1 exiting panics the kernel, and panic=-1 resets too
}
