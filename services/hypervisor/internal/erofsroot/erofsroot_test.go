package erofsroot

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// stream is a root's tar stream as ocirootfs writes it.
func stream(t *testing.T) []byte {
	t.Helper()
	mt := time.Unix(1700000000, 0)
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for _, h := range []*tar.Header{
		{Name: "etc/", Typeflag: tar.TypeDir, Mode: 0o755, ModTime: mt},
		{Name: "etc/shadow", Typeflag: tar.TypeReg, Mode: 0o640, Uid: 0, Gid: 42, Size: 6, ModTime: mt},
		{Name: "usr/bin/tool", Typeflag: tar.TypeReg, Mode: 0o4755, Size: 4, ModTime: mt,
			PAXRecords: map[string]string{"SCHILY.xattr.user.origin": "oci"}, Format: tar.FormatPAX},
		{Name: "usr/bin/tool2", Typeflag: tar.TypeLink, Linkname: "usr/bin/tool"},
		{Name: "bin", Typeflag: tar.TypeSymlink, Linkname: "usr/bin", ModTime: mt},
		{Name: "tmp/", Typeflag: tar.TypeDir, Mode: 0o1777, ModTime: mt},
		{Name: "home/app/", Typeflag: tar.TypeDir, Mode: 0o700, Uid: 1000, Gid: 1000, ModTime: mt},
	} {
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		switch h.Name {
		case "etc/shadow":
			tw.Write([]byte("secret"))
		case "usr/bin/tool":
			tw.Write([]byte("#!x\n"))
		}
	}
	tw.Close()
	return b.Bytes()
}

func needTools(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"mkfs.erofs", "fsck.erofs"} {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s is missing (erofs-utils; make deps installs it)", tool)
			}
			t.Skipf("%s is missing (erofs-utils)", tool)
		}
	}
	if os.Geteuid() != 0 {
		t.Skip("owners are kept only by root: run as root")
	}
}

// The image holds the stream's root: contents, owners, modes (setuid,
// sticky), a hard link, a symlink, an xattr, as the kernel mounts it.
func TestBuildKeepsTheRoot(t *testing.T) {
	needTools(t)
	dir := t.TempDir()
	img := filepath.Join(dir, "root.erofs")
	if err := Build(context.Background(), bytes.NewReader(stream(t)), img, Options{}); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "mnt")
	os.Mkdir(out, 0o755)
	if b, err := exec.Command("mount", "-t", "erofs", "-o", "loop,ro", img, out).CombinedOutput(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("mount the erofs image: %v: %s", err, b)
		}
		t.Skipf("cannot mount an erofs image here (%v: %s)", err, bytes.TrimSpace(b))
	}
	t.Cleanup(func() { _ = exec.Command("umount", out).Run() })
	st := func(name string) *syscall.Stat_t {
		fi, err := os.Lstat(filepath.Join(out, name))
		if err != nil {
			t.Fatal(err)
		}
		return fi.Sys().(*syscall.Stat_t)
	}
	if b, _ := os.ReadFile(filepath.Join(out, "etc/shadow")); string(b) != "secret" {
		t.Errorf("etc/shadow: %q", b)
	}
	if s := st("etc/shadow"); s.Gid != 42 || s.Mode&0o7777 != 0o640 {
		t.Errorf("etc/shadow gid %d mode %o", s.Gid, s.Mode&0o7777)
	}
	if s, s2 := st("usr/bin/tool"), st("usr/bin/tool2"); s.Mode&0o7777 != 0o4755 || s.Nlink != 2 || s.Ino != s2.Ino {
		t.Errorf("usr/bin/tool mode %o links %d, tool2 another inode: %v", s.Mode&0o7777, s.Nlink, s.Ino != s2.Ino)
	}
	if s := st("tmp"); s.Mode&0o7777 != 0o1777 {
		t.Errorf("tmp mode %o", s.Mode&0o7777)
	}
	if s := st("home/app"); s.Uid != 1000 || s.Mode&0o7777 != 0o700 {
		t.Errorf("home/app uid %d mode %o", s.Uid, s.Mode&0o7777)
	}
	if l, _ := os.Readlink(filepath.Join(out, "bin")); l != "usr/bin" {
		t.Errorf("bin -> %q", l)
	}
	buf := make([]byte, 16)
	if n, err := unix.Getxattr(filepath.Join(out, "usr/bin/tool"), "user.origin", buf); err != nil || string(buf[:n]) != "oci" {
		t.Errorf("xattr user.origin: %q %v", buf[:max(n, 0)], err)
	}
}

// The same stream gives the same bytes.
func TestBuildIsReproducible(t *testing.T) {
	needTools(t)
	var imgs [][]byte
	for range 2 {
		dir := t.TempDir()
		img := filepath.Join(dir, "root.erofs")
		if err := Build(context.Background(), bytes.NewReader(stream(t)), img, Options{}); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(img)
		if err != nil {
			t.Fatal(err)
		}
		imgs = append(imgs, b)
	}
	if !bytes.Equal(imgs[0], imgs[1]) {
		t.Fatal("two builds of one stream differ")
	}
}

// A stream cannot write outside the staging tree, whatever its names.
func TestUnpackStaysInside(t *testing.T) {
	for _, h := range []*tar.Header{
		{Name: "../escape", Typeflag: tar.TypeReg, Mode: 0o644},
		{Name: "a/../../escape", Typeflag: tar.TypeReg, Mode: 0o644},
	} {
		parent := t.TempDir()
		dir := filepath.Join(parent, "stage")
		os.Mkdir(dir, 0o700)
		var b bytes.Buffer
		tw := tar.NewWriter(&b)
		tw.WriteHeader(h)
		tw.Close()
		err := unpack(context.Background(), &b, dir)
		if _, serr := os.Lstat(filepath.Join(parent, "escape")); serr == nil {
			t.Fatalf("%s was written outside (err %v)", h.Name, err)
		}
		if err == nil {
			t.Errorf("%s: no error", h.Name)
		}
	}
	// Through a symlink that points out.
	parent := t.TempDir()
	dir := filepath.Join(parent, "stage")
	os.Mkdir(dir, 0o700)
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	tw.WriteHeader(&tar.Header{Name: "out", Typeflag: tar.TypeSymlink, Linkname: parent})
	tw.WriteHeader(&tar.Header{Name: "out/escape", Typeflag: tar.TypeReg, Mode: 0o644})
	tw.Close()
	err := unpack(context.Background(), &b, dir)
	if _, serr := os.Lstat(filepath.Join(parent, "escape")); serr == nil || err == nil {
		t.Fatalf("written through a symlink out (err %v)", err)
	}
}
