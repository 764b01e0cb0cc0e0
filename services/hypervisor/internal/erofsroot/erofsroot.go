// Package erofsroot turns a root filesystem's tar stream (ocirootfs'
// output) into an erofs image with mkfs.erofs. This host's erofs-utils (1.5)
// cannot read a tar, so the stream is unpacked into a staging directory
// first, through an os.Root: no entry can reach outside it, whatever its
// name or a symlink says. Owners, modes, hard links and xattrs are kept
// (owners need root); every mtime is 0 (-T0), which makes the same stream
// give the same image: erofs-utils 1.5 cannot keep mtimes reproducibly (its
// superblock takes the build time).
package erofsroot

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Options are how the image is written.
type Options struct {
	// MkfsBinary is mkfs.erofs (default: from PATH).
	MkfsBinary string
	// UUID is the filesystem's (fixed, for a reproducible image).
	UUID string
	// TempDir holds the staging tree (default: beside out).
	TempDir string
	// Subdir puts the stream's tree under this directory of the image
	// (default: at its top), beside Files.
	Subdir string
	// Files are written at the image's top, read-only (name: content).
	Files map[string][]byte
}

const xattrPrefix = "SCHILY.xattr."

// Build writes the erofs image of the root in stream to out.
func Build(ctx context.Context, stream io.Reader, out string, o Options) error {
	if o.MkfsBinary == "" {
		o.MkfsBinary = "mkfs.erofs"
	}
	if o.UUID == "" {
		o.UUID = "00000000-0000-0000-0000-000000000000"
	}
	if o.TempDir == "" {
		o.TempDir = filepath.Dir(out)
	}
	staging, err := os.MkdirTemp(o.TempDir, ".erofsroot-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(staging)
	tree := staging
	if o.Subdir != "" {
		tree = filepath.Join(staging, o.Subdir)
		if err := os.Chmod(staging, 0o755); err != nil {
			return err
		}
		if err := os.Mkdir(tree, 0o755); err != nil {
			return err
		}
	}
	if err := unpack(ctx, stream, tree); err != nil {
		return err
	}
	for name, b := range o.Files {
		if name == "" || strings.ContainsRune(name, '/') || name == o.Subdir {
			return fmt.Errorf("erofsroot: file name %q", name)
		}
		if err := os.WriteFile(filepath.Join(staging, name), b, 0o444); err != nil {
			return err
		}
		if err := setMtime(staging, name, time.Unix(0, 0)); err != nil {
			return err
		}
	}
	if o.Subdir != "" {
		if err := setMtime(staging, o.Subdir, time.Unix(0, 0)); err != nil {
			return err
		}
	}
	cmd := exec.CommandContext(ctx, o.MkfsBinary, "--quiet", "-U"+o.UUID, "-T0", out, staging)
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("mkfs.erofs: %v: %s", err, strings.TrimSpace(string(b)))
	}
	return nil
}

// unpack writes the stream's entries under dir, then the directories'
// modes and mtimes (after their contents: a read-only directory is filled
// first).
func unpack(ctx context.Context, stream io.Reader, dir string) error {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	type dirMeta struct {
		name string
		hdr  *tar.Header
	}
	var dirs []dirMeta
	tr := tar.NewReader(stream)
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("root stream: %w", err)
		}
		name := filepath.Clean(strings.TrimSuffix(hdr.Name, "/"))
		if name == "." {
			continue
		}
		if parent := filepath.Dir(name); parent != "." {
			if err := root.MkdirAll(parent, 0o755); err != nil {
				return fmt.Errorf("%s: %w", hdr.Name, err)
			}
		}
		switch hdr.Typeflag {
		case tar.TypeDir:
			if err := root.Mkdir(name, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
				return fmt.Errorf("%s: %w", hdr.Name, err)
			}
			dirs = append(dirs, dirMeta{name, hdr})
			if err := own(root, dir, name, hdr); err != nil {
				return err
			}
			continue
		case tar.TypeReg:
			f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
			if err != nil {
				return fmt.Errorf("%s: %w", hdr.Name, err)
			}
			_, err = io.Copy(f, tr)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return fmt.Errorf("%s: %w", hdr.Name, err)
			}
		case tar.TypeSymlink:
			if err := root.Symlink(hdr.Linkname, name); err != nil {
				return fmt.Errorf("%s: %w", hdr.Name, err)
			}
		case tar.TypeLink:
			if err := root.Link(filepath.Clean(hdr.Linkname), name); err != nil {
				return fmt.Errorf("%s: %w", hdr.Name, err)
			}
			continue // the target's metadata is the link's
		case tar.TypeFifo:
			if err := unix.Mkfifo(filepath.Join(dir, name), 0o600); err != nil {
				return fmt.Errorf("%s: %w", hdr.Name, err)
			}
		default:
			return fmt.Errorf("%s: tar entry type %q is not in a root stream", hdr.Name, hdr.Typeflag)
		}
		if err := own(root, dir, name, hdr); err != nil {
			return err
		}
		if hdr.Typeflag != tar.TypeSymlink {
			if err := root.Chmod(name, os.FileMode(hdr.Mode)&os.ModePerm|specialBits(hdr.Mode)); err != nil {
				return fmt.Errorf("%s: %w", hdr.Name, err)
			}
		}
		if err := setMtime(dir, name, hdr.ModTime); err != nil {
			return err
		}
	}
	for i := len(dirs) - 1; i >= 0; i-- { // children before their parents
		d := dirs[i]
		if err := root.Chmod(d.name, os.FileMode(d.hdr.Mode)&os.ModePerm|specialBits(d.hdr.Mode)); err != nil {
			return fmt.Errorf("%s: %w", d.hdr.Name, err)
		}
	}
	// Mtimes last: writing into a directory changes its own.
	for i := len(dirs) - 1; i >= 0; i-- {
		if err := setMtime(dir, dirs[i].name, dirs[i].hdr.ModTime); err != nil {
			return err
		}
	}
	return setMtime(dir, ".", time.Unix(0, 0))
}

// own sets an entry's owner and xattrs (the entry is root's child: the
// names are checked by the os.Root that made it).
func own(root *os.Root, dir, name string, hdr *tar.Header) error {
	if err := root.Lchown(name, hdr.Uid, hdr.Gid); err != nil {
		return fmt.Errorf("%s: %w", hdr.Name, err)
	}
	for k, v := range hdr.PAXRecords {
		if attr, ok := strings.CutPrefix(k, xattrPrefix); ok {
			if err := unix.Lsetxattr(filepath.Join(dir, name), attr, []byte(v), 0); err != nil {
				return fmt.Errorf("%s: xattr %s: %w", hdr.Name, attr, err)
			}
		}
	}
	return nil
}

// setMtime sets an entry's mtime (a symlink's own, not its target's).
func setMtime(dir, name string, t time.Time) error {
	ts := []unix.Timespec{unix.NsecToTimespec(t.UnixNano()), unix.NsecToTimespec(t.UnixNano())}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, filepath.Join(dir, name), ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("%s: mtime: %w", name, err)
	}
	return nil
}

// specialBits are a tar mode's setuid, setgid and sticky bits.
func specialBits(mode int64) os.FileMode {
	var m os.FileMode
	if mode&0o4000 != 0 {
		m |= os.ModeSetuid
	}
	if mode&0o2000 != 0 {
		m |= os.ModeSetgid
	}
	if mode&0o1000 != 0 {
		m |= os.ModeSticky
	}
	return m
}
