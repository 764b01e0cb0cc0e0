// Package installer is vm-agent's install phase: it copies the read-only
// installer disk (the image's .raw) onto the VM's target volume and proves the
// copy by reading it back. The host starts it with the SMBIOS credential
// vm.install-target and -no-reboot; vm-agent then powers off on success and
// resets on failure, which the host sees as QMP SHUTDOWN guest-reset.
package installer

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Credential is the SMBIOS credential that makes vm-agent the installer.
const Credential = "vm.install-target"

// SourceSerial is the virtio-blk serial of the disk that is copied.
const SourceSerial = "installer"

// byIDPrefix is how the credential names the target: udev's by-id link of a
// virtio disk. There is no udev here, so the serial is looked up in sysfs.
const byIDPrefix = "/dev/disk/by-id/virtio-"

// chunk is the copy and read-back unit (dd bs=4M measured 64 MiB in 0.77 s).
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
	SHA256                 string // of the source, equal to the read-back target range
	Copy, ReadBack         time.Duration
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

// Run resolves both disks, refuses a source larger than the target, copies,
// syncs, reads the written range back and compares its sha256 with the
// source's. Any error means the target must not be booted.
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
	sum, err := copyHashed(dst, src, r.SourceSize)
	if err != nil {
		return nil, err
	}
	if err := dst.Sync(); err != nil {
		return nil, fmt.Errorf("fsync %s: %w", dstPath, err)
	}
	r.Copy = c.Now().Sub(start)
	r.SHA256 = hex.EncodeToString(sum)
	c.Logf("installer: copied %d bytes in %.2fs, sha256 %s", r.SourceSize, r.Copy.Seconds(), r.SHA256)

	// Drop the cached pages so the read-back comes from the device, not from
	// what was just written into memory.
	_ = unix.Fadvise(int(dst.Fd()), 0, r.SourceSize, unix.FADV_DONTNEED)
	start = c.Now()
	back, err := hashRange(dst, r.SourceSize)
	if err != nil {
		return nil, fmt.Errorf("reading back %s: %w", dstPath, err)
	}
	r.ReadBack = c.Now().Sub(start)
	if got := hex.EncodeToString(back); got != r.SHA256 {
		return nil, fmt.Errorf("copy does not verify: target's first %d bytes have sha256 %s, source %s", r.SourceSize, got, r.SHA256)
	}
	c.Logf("installer: read back %d bytes in %.2fs: sha256 matches", r.SourceSize, r.ReadBack.Seconds())
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

// copyHashed copies n bytes and returns the sha256 of what was read.
func copyHashed(dst, src File, n int64) ([]byte, error) {
	h := sha256.New()
	buf := make([]byte, chunk)
	for off := int64(0); off < n; {
		b := buf[:min(int64(len(buf)), n-off)]
		if _, err := src.ReadAt(b, off); err != nil {
			return nil, fmt.Errorf("reading the installer disk at %d: %w", off, err)
		}
		h.Write(b)
		w, err := dst.WriteAt(b, off)
		if err == nil && w != len(b) {
			err = io.ErrShortWrite
		}
		if err != nil {
			return nil, fmt.Errorf("writing the target at %d (%d of %d bytes): %w", off, w, len(b), err)
		}
		off += int64(len(b))
	}
	return h.Sum(nil), nil
}

// hashRange is the sha256 of f's first n bytes.
func hashRange(f File, n int64) ([]byte, error) {
	h := sha256.New()
	if _, err := io.CopyBuffer(h, io.NewSectionReader(f, 0, n), make([]byte, chunk)); err != nil {
		return nil, err
	}
	return h.Sum(nil), nil
}
