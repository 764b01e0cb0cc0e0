// Package installer is vm-agent's install phase: it copies the read-only
// installer disk (the image's .raw) onto the VM's target volume; the host
// proves the copy against the image once the machine is off. The host starts
// it with the SMBIOS credential vm.install-target and -no-reboot; vm-agent
// then powers off on success and resets on failure, which the host sees as
// QMP SHUTDOWN guest-reset.
package installer

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Credential is the SMBIOS credential that makes vm-agent the installer.
const Credential = "vm.install-target"

// SourceSerial is the virtio-blk serial of the disk that is copied.
const SourceSerial = "installer"

// byIDPrefix is how the credential names the target: udev's by-id link of a
// virtio disk. There is no udev here, so the serial is looked up in sysfs.
const byIDPrefix = "/dev/disk/by-id/virtio-"

// chunk is the copy unit (dd bs=4M measured 64 MiB in 0.77 s).
const chunk = 4 << 20

// File is what the installer needs of a disk; *os.File in production.
type File interface {
	io.ReaderAt
	io.WriterAt
	io.Seeker
	Sync() error
	Fd() uintptr
	Close() error
}

// Config is one install. The zero value of the roots means the real system.
type Config struct {
	Target  string // the credential's value, /dev/disk/by-id/virtio-<serial>
	SysRoot string // "/sys"
	DevRoot string // "/dev"
	// Wait bounds the wait for the disks to show up in sysfs and /dev: virtio
	// probing and devtmpfs nodes may trail the module load.
	Wait time.Duration
	// Open opens a disk; os.OpenFile when nil. Tests wrap it to break writes.
	Open  func(path string, flag int) (File, error)
	Logf  func(format string, args ...any)
	Now   func() time.Time
	Sleep func(time.Duration)
}

// Result is what an install did.
type Result struct {
	Source, Target         string // device paths
	SourceSize, TargetSize int64
	// Written and Zeroed split SourceSize: chunks copied, and chunks of
	// zeros the target was told to zero instead (most of an image's empty
	// var partition).
	Written, Zeroed int64
	Copy            time.Duration
}

func (c *Config) defaults() {
	if c.SysRoot == "" {
		c.SysRoot = "/sys"
	}
	if c.DevRoot == "" {
		c.DevRoot = "/dev"
	}
	if c.Open == nil {
		c.Open = func(p string, flag int) (File, error) { return os.OpenFile(p, flag, 0) }
	}
	if c.Logf == nil {
		c.Logf = func(string, ...any) {}
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Sleep == nil {
		c.Sleep = time.Sleep
	}
}

// TargetSerial is the serial the credential names.
func TargetSerial(cred string) (string, error) {
	s, ok := strings.CutPrefix(strings.TrimSpace(cred), byIDPrefix)
	if !ok || !validSerial(s) {
		return "", fmt.Errorf("%s=%q: want %s<serial> (1-20 characters of [A-Za-z0-9._-])", Credential, cred, byIDPrefix)
	}
	if s == SourceSerial {
		return "", fmt.Errorf("%s=%q names the installer disk itself", Credential, cred)
	}
	return s, nil
}

// validSerial is the host's rule for disk serials (contract §4.1).
func validSerial(s string) bool {
	if len(s) == 0 || len(s) > 20 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// FindDisk maps a virtio serial to its device node through sysRoot/block/*/serial.
func FindDisk(sysRoot, devRoot, serial string) (string, error) {
	paths, _ := filepath.Glob(filepath.Join(sysRoot, "block", "*", "serial"))
	var found []string
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil || strings.TrimSpace(string(b)) != serial {
			continue
		}
		found = append(found, filepath.Base(filepath.Dir(p)))
	}
	switch len(found) {
	case 0:
		return "", fmt.Errorf("no disk with serial %q in %s/block", serial, sysRoot)
	case 1:
		return filepath.Join(devRoot, found[0]), nil
	}
	return "", fmt.Errorf("serial %q is on several disks (%s)", serial, strings.Join(found, ", "))
}

// findWaiting is FindDisk retried until the node exists or c.Wait has passed.
func (c *Config) findWaiting(serial string) (string, error) {
	deadline := c.Now().Add(c.Wait)
	for {
		dev, err := FindDisk(c.SysRoot, c.DevRoot, serial)
		if err == nil {
			if _, err = os.Stat(dev); err == nil {
				return dev, nil
			}
		}
		if !c.Now().Before(deadline) {
			return "", err
		}
		c.Sleep(100 * time.Millisecond)
	}
}

// Run resolves both disks, refuses a source larger than the target, copies
// and syncs. Any error means the target must not be booted. The copy is not
// read back here: under emulation that doubled the install, and the host
// compares the volume with the image itself once the installer has powered
// off, which also catches a copy of the wrong bytes.
func Run(c Config) (*Result, error) {
	c.defaults()
	serial, err := TargetSerial(c.Target)
	if err != nil {
		return nil, err
	}
	srcPath, err := c.findWaiting(SourceSerial)
	if err != nil {
		return nil, fmt.Errorf("installer disk: %w", err)
	}
	dstPath, err := c.findWaiting(serial)
	if err != nil {
		return nil, fmt.Errorf("target disk: %w", err)
	}
	if srcPath == dstPath {
		return nil, fmt.Errorf("source and target are both %s", srcPath)
	}
	src, err := c.Open(srcPath, os.O_RDONLY)
	if err != nil {
		return nil, fmt.Errorf("opening the installer disk: %w", err)
	}
	defer src.Close()
	dst, err := c.Open(dstPath, os.O_RDWR)
	if err != nil {
		return nil, fmt.Errorf("opening the target disk: %w", err)
	}
	defer dst.Close()

	r := &Result{Source: srcPath, Target: dstPath}
	if r.SourceSize, err = size(src); err != nil {
		return nil, fmt.Errorf("%s: %w", srcPath, err)
	}
	if r.TargetSize, err = size(dst); err != nil {
		return nil, fmt.Errorf("%s: %w", dstPath, err)
	}
	c.Logf("installer: source %s (serial %s, %d bytes), target %s (serial %s, %d bytes)",
		srcPath, SourceSerial, r.SourceSize, dstPath, serial, r.TargetSize)
	if r.SourceSize == 0 {
		return nil, fmt.Errorf("installer disk %s is empty", srcPath)
	}
	if r.SourceSize > r.TargetSize {
		return nil, fmt.Errorf("installer disk %s (%d bytes) is larger than target %s (%d bytes)", srcPath, r.SourceSize, dstPath, r.TargetSize)
	}

	start := c.Now()
	if err := copyChunks(dst, src, r); err != nil {
		return nil, err
	}
	if err := dst.Sync(); err != nil {
		return nil, fmt.Errorf("fsync %s: %w", dstPath, err)
	}
	r.Copy = c.Now().Sub(start)
	c.Logf("installer: copied %d bytes in %.2fs (%d written, %d zeroed)", r.SourceSize, r.Copy.Seconds(), r.Written, r.Zeroed)
	return r, nil
}

// size is the length of a file or block device (seeking to its end works for both).
func size(f File) (int64, error) {
	n, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return 0, fmt.Errorf("size: %w", err)
	}
	return n, nil
}

// copyChunks copies r.SourceSize bytes. A chunk of zeros is not written: the
// target is told to zero its range (a run of such chunks at once), which the
// host does by punching a hole in the volume's file.
func copyChunks(dst, src File, r *Result) error {
	buf := make([]byte, chunk)
	var zeroFrom, zeroLen int64
	flush := func() error {
		if zeroLen == 0 {
			return nil
		}
		if err := zeroRange(dst, zeroFrom, zeroLen); err != nil {
			return fmt.Errorf("zeroing the target at %d (%d bytes): %w", zeroFrom, zeroLen, err)
		}
		r.Zeroed += zeroLen
		zeroLen = 0
		return nil
	}
	n := r.SourceSize
	for off := int64(0); off < n; {
		b := buf[:min(int64(len(buf)), n-off)]
		if _, err := src.ReadAt(b, off); err != nil {
			return fmt.Errorf("reading the installer disk at %d: %w", off, err)
		}
		if allZero(b) {
			if zeroLen == 0 {
				zeroFrom = off
			}
			zeroLen += int64(len(b))
			off += int64(len(b))
			continue
		}
		if err := flush(); err != nil {
			return err
		}
		w, err := dst.WriteAt(b, off)
		if err == nil && w != len(b) {
			err = io.ErrShortWrite
		}
		if err != nil {
			return fmt.Errorf("writing the target at %d (%d of %d bytes): %w", off, w, len(b), err)
		}
		r.Written += int64(len(b))
		off += int64(len(b))
	}
	return flush()
}

var zeros = make([]byte, chunk)

func allZero(b []byte) bool { return bytes.Equal(b, zeros[:len(b)]) }

// zeroRange zeroes n bytes at off: BLKZEROOUT on a block device (virtio-blk
// passes it to the host as write-zeroes), fallocate on a file, else writes.
func zeroRange(f File, off, n int64) error {
	fd := int(f.Fd())
	rng := [2]uint64{uint64(off), uint64(n)}
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.BLKZEROOUT, uintptr(unsafe.Pointer(&rng)))
	if errno == 0 {
		return nil
	}
	if errno != unix.ENOTTY && errno != unix.EINVAL && errno != unix.EOPNOTSUPP {
		return errno
	}
	if err := unix.Fallocate(fd, unix.FALLOC_FL_ZERO_RANGE|unix.FALLOC_FL_KEEP_SIZE, off, n); err == nil {
		return nil
	}
	for done := int64(0); done < n; {
		m := min(int64(len(zeros)), n-done)
		w, err := f.WriteAt(zeros[:m], off+done)
		if err == nil && int64(w) != m {
			err = io.ErrShortWrite
		}
		if err != nil {
			return err
		}
		done += m
	}
	return nil
}
