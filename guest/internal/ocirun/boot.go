// Package ocirun boots an imported OCI image's root in the test guest (PID 1
// is vm-agent): it checks the root's dm-verity root hash in userspace and
// measures it into PCR 15 before anything of it is used, mounts it through
// dm-verity with an overlay on the VM's own disk, and runs the image's
// entrypoint chrooted into it, supervised; the host's exec sessions run
// there too. The contract with the host is pkg/ociboot.
package ocirun

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"time"

	"golang.org/x/sys/unix"

	"github.com/giantswarm/vm-manager/guest/internal/installer"
	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/giantswarm/vm-manager/pkg/ociboot"
	"github.com/giantswarm/vm-manager/pkg/verity"
)

// Defaults of Options.
const (
	DefaultDir      = "/oci"
	DefaultBusybox  = "/bin/busybox"
	DefaultDiskWait = 10 * time.Second
	// MapperName is the dm-verity device's name (/dev/mapper/oci-root).
	MapperName = "oci-root"
)

// Options say where Boot finds and puts things; the zero value is PID 1's.
type Options struct {
	Cmdline string // the kernel command line
	Logf    func(format string, args ...any)
	// Measure extends a word into a PCR and logs it (pcrextend.Extender).
	Measure func(pcr uint32, word, eventType string) error
	// StartCmd starts a child so that PID 1's reaper spares it.
	StartCmd func(*exec.Cmd) (done func(), err error)
	SysRoot  string        // "/sys"
	DevRoot  string        // "/dev"
	Dir      string        // DefaultDir: bundle/, rw/ and root/ go below
	Busybox  string        // DefaultBusybox: mke2fs, and the shell of shell-less images
	DiskWait time.Duration // DefaultDiskWait, per disk
}

func (o *Options) defaults() {
	if o.Logf == nil {
		o.Logf = func(string, ...any) {}
	}
	if o.StartCmd == nil {
		o.StartCmd = func(c *exec.Cmd) (func(), error) { return func() {}, c.Start() }
	}
	if o.SysRoot == "" {
		o.SysRoot = "/sys"
	}
	if o.DevRoot == "" {
		o.DevRoot = "/dev"
	}
	if o.Dir == "" {
		o.Dir = DefaultDir
	}
	if o.Busybox == "" {
		o.Busybox = DefaultBusybox
	}
	if o.DiskWait <= 0 {
		o.DiskWait = DefaultDiskWait
	}
}

// Boot boots the root the command line names. named is false when it names
// none (nothing else happened); with named true and a nil root the root was
// refused or failed, and the console says why: the boot goes on without it,
// so the host's attestation can refuse it and say so too.
func Boot(o Options) (named bool, root *Root) {
	o.defaults()
	want, named, err := ociboot.ParseCmdline(o.Cmdline)
	if !named {
		return false, nil
	}
	refuse := func(format string, args ...any) (bool, *Root) {
		o.Logf("OCI root refused: "+format+": not mounting it", args...)
		return true, nil
	}
	if err != nil {
		return refuse("%v", err)
	}
	var disks [3]string
	for i, serial := range []string{ociboot.SerialRoot, ociboot.SerialVerity, ociboot.SerialUpper} {
		if disks[i], err = waitDisk(o.SysRoot, o.DevRoot, serial, o.DiskWait); err != nil {
			return refuse("%v", err)
		}
	}
	start := time.Now()
	got, err := RootHash(disks[0], want)
	if err != nil {
		return refuse("%v", err)
	}
	gotHex := hex.EncodeToString(got)
	o.Logf("OCI root: verity root hash %s over %d blocks of %s in %.2fs", gotHex, want.DataBlocks, disks[0], time.Since(start).Seconds())
	// Measured before it is compared or used: a quote then names what this
	// guest found, whatever the command line said.
	word := measure.VerityRootWord(gotHex)
	if o.Measure == nil {
		o.Logf("warning: OCI root: no TPM extender: verity root not measured")
	} else if err := o.Measure(measure.PCRVerityRoot, word, measure.EventTypeVerityRoot); err != nil {
		o.Logf("warning: OCI root: measuring %q into PCR %d: %v", word, measure.PCRVerityRoot, err)
	} else {
		o.Logf("OCI root: %q extended into PCR %d", word, measure.PCRVerityRoot)
	}
	if !bytes.Equal(got, want.RootHash) {
		return refuse("verity root hash %s is not the command line's %x", gotHex, want.RootHash)
	}
	want.RootHash = got
	r, err := mountRoot(&o, want, disks[0], disks[1], disks[2])
	if err != nil {
		o.Logf("OCI root failed: %v: not running it", err)
		return true, nil
	}
	return true, r
}

// waitDisk finds the virtio disk with serial through sysfs (no udev here),
// waiting up to wait for it and its node to appear.
func waitDisk(sysRoot, devRoot, serial string, wait time.Duration) (string, error) {
	deadline := time.Now().Add(wait)
	for {
		dev, err := installer.FindDisk(sysRoot, devRoot, serial)
		if err == nil {
			if _, err = os.Stat(dev); err == nil {
				return dev, nil
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("disk %q: %w", serial, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// RootHash computes the verity root hash of the first r.DataBlocks blocks
// of dev with r's salt, reading all of them: a changed byte anywhere shows.
func RootHash(dev string, r ociboot.Root) ([]byte, error) {
	f, err := os.Open(dev)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	size, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return nil, err
	}
	need := int64(r.DataBlocks) * ociboot.BlockSize
	if need/ociboot.BlockSize != int64(r.DataBlocks) || size < need {
		return nil, fmt.Errorf("%s holds %d bytes, less than the command line's %d blocks", dev, size, r.DataBlocks)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, err
	}
	// Large reads: a syscall per 4 KiB block is slow under emulation.
	return verity.Format(bufio.NewReaderSize(f, 1<<20), need, io.Discard, verity.Params{Salt: r.Salt})
}

// devNumber is a block device node's "major:minor", as a dm table names it.
func devNumber(node string) (string, error) {
	var st unix.Stat_t
	if err := unix.Stat(node, &st); err != nil {
		return "", fmt.Errorf("stat %s: %w", node, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFBLK {
		return "", fmt.Errorf("%s is not a block device", node)
	}
	return fmt.Sprintf("%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev)), nil
}
