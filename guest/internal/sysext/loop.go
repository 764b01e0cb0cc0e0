package sysext

import (
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// LoopMount merges an image as systemd-sysext would mount it: a read-only
// loop device with autoclear, mounted as erofs read-only, nodev, nosuid.
type LoopMount struct {
	DevRoot string // "/dev"
}

func (l LoopMount) dev() string {
	if l.DevRoot == "" {
		return "/dev"
	}
	return l.DevRoot
}

// Merge attaches image to a free loop device and mounts it at dir.
func (l LoopMount) Merge(image, dir string) error {
	backing, err := os.OpenFile(image, os.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer backing.Close()
	loop, err := l.attach(backing, image)
	if err != nil {
		return err
	}
	// Autoclear detaches the device when its last user goes: the mount must
	// hold it before loop is closed.
	defer loop.Close()
	err = unix.Mount(loop.Name(), dir, "erofs", unix.MS_RDONLY|unix.MS_NODEV|unix.MS_NOSUID, "")
	if err != nil {
		_ = unix.IoctlSetInt(int(loop.Fd()), unix.LOOP_CLR_FD, 0)
		return fmt.Errorf("mount -t erofs %s on %s: %w", loop.Name(), dir, err)
	}
	return nil
}

// Unmerge unmounts dir; autoclear then frees the loop device.
func (l LoopMount) Unmerge(dir string) error { return unix.Unmount(dir, 0) }

// attach configures a free loop device on backing, read-only. A device
// another process grabbed in between (EBUSY) makes it ask for the next.
func (l LoopMount) attach(backing *os.File, image string) (*os.File, error) {
	ctl, err := os.OpenFile(l.dev()+"/loop-control", os.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer ctl.Close()
	for attempt := 0; ; attempt++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, fmt.Errorf("LOOP_CTL_GET_FREE: %w", err)
		}
		loop, err := openWait(fmt.Sprintf("%s/loop%d", l.dev(), n))
		if err != nil {
			return nil, err
		}
		cfg := unix.LoopConfig{Fd: uint32(backing.Fd())}
		cfg.Info.Flags = unix.LO_FLAGS_READ_ONLY | unix.LO_FLAGS_AUTOCLEAR
		copy(cfg.Info.File_name[:len(cfg.Info.File_name)-1], image)
		err = unix.IoctlLoopConfigure(int(loop.Fd()), &cfg)
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOTTY) {
			err = setFD(loop, backing, cfg.Info) // a kernel before 5.8
		}
		if err == nil {
			return loop, nil
		}
		loop.Close()
		if !errors.Is(err, unix.EBUSY) || attempt == 4 {
			return nil, fmt.Errorf("configuring %s: %w", loop.Name(), err)
		}
	}
}

func setFD(loop, backing *os.File, info unix.LoopInfo64) error {
	if err := unix.IoctlSetInt(int(loop.Fd()), unix.LOOP_SET_FD, int(backing.Fd())); err != nil {
		return err
	}
	if err := unix.IoctlLoopSetStatus64(int(loop.Fd()), &info); err != nil {
		_ = unix.IoctlSetInt(int(loop.Fd()), unix.LOOP_CLR_FD, 0)
		return err
	}
	return nil
}

// openWait opens a loop device node, which devtmpfs may create a moment
// after LOOP_CTL_GET_FREE made the device.
func openWait(path string) (*os.File, error) {
	for i := 0; ; i++ {
		f, err := os.OpenFile(path, os.O_RDONLY|unix.O_CLOEXEC, 0)
		if err == nil || !errors.Is(err, os.ErrNotExist) || i == 50 {
			return f, err
		}
		time.Sleep(20 * time.Millisecond)
	}
}
