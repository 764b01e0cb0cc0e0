package ocirun

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/giantswarm/vm-manager/pkg/ociboot"
)

// maxConfig bounds image.json as read.
const maxConfig = 1 << 20

// mountRoot is the dm-verity device over the checked disks, its erofs, the
// overlay on the upper disk, and a container's mounts inside.
func mountRoot(o *Options, want ociboot.Root, rootDev, hashDev, upperDev string) (*Root, error) {
	data, err := devNumber(rootDev)
	if err != nil {
		return nil, err
	}
	hash, err := devNumber(hashDev)
	if err != nil {
		return nil, err
	}
	typ, params := splitTable(want.Table(data, hash))
	dev, err := createReadOnlyDM(filepath.Join(o.DevRoot, "mapper", "control"), MapperName,
		dmTarget{Length: want.Sectors(), Type: typ, Params: params})
	if err != nil {
		return nil, err
	}
	// Our own node: devtmpfs names it dm-<minor>, maybe a moment later.
	node := filepath.Join(o.DevRoot, "mapper", MapperName)
	if err := unix.Mknod(node, unix.S_IFBLK|0o600, int(unix.Mkdev(unix.Major(dev), unix.Minor(dev)))); err != nil && !errors.Is(err, unix.EEXIST) {
		return nil, fmt.Errorf("mknod %s: %w", node, err)
	}
	o.Logf("OCI root: dm-verity device %s (%d:%d) over %s and %s", node, unix.Major(dev), unix.Minor(dev), rootDev, hashDev)
	return mountBundle(o, node, upperDev)
}

// mountBundle mounts the verity device's erofs (bundle), reads its config,
// prepares the upper disk and mounts the overlay and a container's mounts.
// Split from mountRoot so that it runs on a loop device in tests.
func mountBundle(o *Options, bundleDev, upperDev string) (*Root, error) {
	bundle := filepath.Join(o.Dir, "bundle")
	rw := filepath.Join(o.Dir, "rw")
	merged := filepath.Join(o.Dir, "root")
	for _, d := range []string{bundle, rw, merged} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	if err := unix.Mount(bundleDev, bundle, "erofs", unix.MS_RDONLY, ""); err != nil {
		return nil, fmt.Errorf("mount -t erofs %s on %s: %w", bundleDev, bundle, err)
	}
	b, err := readFileIn(bundle, ociboot.ConfigFile, maxConfig)
	if err != nil {
		return nil, fmt.Errorf("the root's %s: %w", ociboot.ConfigFile, err)
	}
	var cfg ociboot.Config
	if err := json.Unmarshal(b, &cfg); err != nil {
		return nil, fmt.Errorf("the root's %s: %w", ociboot.ConfigFile, err)
	}
	lower := filepath.Join(bundle, ociboot.RootfsDir)
	if fi, err := os.Lstat(lower); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("the root has no %s/ directory", ociboot.RootfsDir)
	}
	o.Logf("OCI root: image %s (config %s)", cfg.ManifestDigest, cfg.ConfigDigest)

	formatted, err := prepareUpper(o, upperDev)
	if err != nil {
		return nil, err
	}
	if err := unix.Mount(upperDev, rw, "ext4", 0, ""); err != nil {
		return nil, fmt.Errorf("mount %s on %s: %w", upperDev, rw, err)
	}
	upper, work := filepath.Join(rw, "upper"), filepath.Join(rw, "work")
	for _, d := range []string{upper, work} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", lower, upper, work)
	if err := unix.Mount("overlay", merged, "overlay", 0, opts); err != nil {
		return nil, fmt.Errorf("mount overlay (%s) on %s: %w", opts, merged, err)
	}
	state := "kept from an earlier boot"
	if formatted {
		state = "new"
	}
	o.Logf("OCI root mounted on %s: %s read-only under an overlay on %s (%s)", merged, bundleDev, upperDev, state)
	if err := containerMounts(o.DevRoot, merged); err != nil {
		return nil, err
	}
	return newRoot(o, merged, cfg)
}

// prepareUpper formats the upper disk with ext2 (busybox's mke2fs; the
// kernel's ext4 driver mounts it) when it holds no ext file system and is
// blank at its start; other content is refused rather than overwritten.
func prepareUpper(o *Options, dev string) (formatted bool, err error) {
	f, err := os.Open(dev)
	if err != nil {
		return false, err
	}
	head := make([]byte, 1<<20)
	n, err := io.ReadFull(f, head)
	f.Close()
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) {
		return false, fmt.Errorf("reading %s: %w", dev, err)
	}
	head = head[:n]
	if hasExt(head) {
		return false, nil
	}
	if !allZero(head) {
		return false, fmt.Errorf("%s holds data but no ext2/3/4 file system: not formatting it", dev)
	}
	cmd := exec.Command(o.Busybox, "mke2fs", "-F", "-b", "4096", "-m", "0", "-L", "oci-upper", dev)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	done, err := o.StartCmd(cmd)
	if err == nil {
		err = cmd.Wait()
		done()
	}
	if err != nil {
		return false, fmt.Errorf("mke2fs %s: %v: %s", dev, err, strings.TrimSpace(out.String()))
	}
	o.Logf("OCI root: %s was blank: formatted it (ext2)", dev)
	return true, nil
}

// hasExt finds the ext2/3/4 superblock magic (0xEF53 at byte 56 of the
// superblock, which starts at 1024).
func hasExt(head []byte) bool {
	return len(head) >= 1024+58 && binary.LittleEndian.Uint16(head[1024+56:]) == 0xef53
}

func allZero(b []byte) bool {
	for _, c := range b {
		if c != 0 {
			return false
		}
	}
	return true
}

// innerMount is one mount a container runtime makes inside the root.
type innerMount struct {
	target, source, fstype string
	flags                  uintptr
	data                   string
}

// containerMounts gives the root what a runtime's default spec does: its
// own proc and sysfs, the guest's /dev (with /dev/pts), a /dev/shm, and
// tmpfs /tmp and /run. Targets are resolved inside the root, so no
// symlink in it leads a mount outside.
func containerMounts(devRoot, root string) error {
	const nsd = unix.MS_NOSUID | unix.MS_NODEV
	for _, m := range []innerMount{
		{"/proc", "proc", "proc", nsd | unix.MS_NOEXEC, ""},
		{"/sys", "sysfs", "sysfs", nsd | unix.MS_NOEXEC, ""},
		{"/dev", devRoot, "", unix.MS_BIND | unix.MS_REC, ""},
		{"/dev/shm", "shm", "tmpfs", nsd, "mode=1777"},
		{"/tmp", "tmpfs", "tmpfs", nsd, "mode=1777"},
		{"/run", "tmpfs", "tmpfs", nsd, "mode=0755"},
	} {
		target, err := ResolveIn(root, m.target)
		if err != nil {
			return err
		}
		if err := os.MkdirAll(target, 0o755); err != nil {
			return fmt.Errorf("mount point %s in the root: %w", m.target, err)
		}
		if err := unix.Mount(m.source, target, m.fstype, m.flags, m.data); err != nil {
			return fmt.Errorf("mount %s on %s in the root: %w", m.source, m.target, err)
		}
	}
	return nil
}

// bindFile bind-mounts src onto the file name of the image (made empty, in
// the upper directory, when missing), as runtimes give /etc/resolv.conf.
func bindFile(root, name, src string) error {
	target, err := ResolveIn(root, name)
	if err != nil {
		return err
	}
	if fi, err := os.Stat(target); err == nil && !fi.Mode().IsRegular() {
		return fmt.Errorf("%s in the root is not a file", name)
	} else if err != nil {
		if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
			return fmt.Errorf("%s in the root: %w", name, err)
		}
		f, err := os.OpenFile(target, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		if err != nil {
			return fmt.Errorf("%s in the root: %w", name, err)
		}
		f.Close()
	}
	if err := unix.Mount(src, target, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s on %s in the root: %w", src, name, err)
	}
	return nil
}
