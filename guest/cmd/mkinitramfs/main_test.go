package main

import (
	"bytes"
	"compress/gzip"
	"debug/elf"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// record is one entry read back from a newc archive.
type record struct {
	ino, mode, uid, gid, nlink, mtime uint32
	rmajor, rminor                    uint32
	name                              string
	data                              []byte
}

// readArchive is an independent newc reader: it checks magic, padding and the trailer.
func readArchive(t *testing.T, gz []byte) []record {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(gz))
	if err != nil {
		t.Fatal(err)
	}
	if !zr.ModTime.IsZero() || zr.Name != "" {
		t.Fatalf("gzip header carries time or name: %v %q", zr.ModTime, zr.Name)
	}
	raw, err := io.ReadAll(zr)
	if err != nil {
		t.Fatal(err)
	}
	var recs []record
	off := 0
	align := func(n int) int { return (n + 3) &^ 3 }
	for {
		if off+110 > len(raw) {
			t.Fatalf("truncated header at %d", off)
		}
		h := string(raw[off : off+110])
		if h[:6] != "070701" {
			t.Fatalf("bad magic %q at %d", h[:6], off)
		}
		field := func(i int) uint32 {
			v, err := strconv.ParseUint(h[6+8*i:14+8*i], 16, 32)
			if err != nil {
				t.Fatalf("field %d at %d: %v", i, off, err)
			}
			return uint32(v)
		}
		r := record{ino: field(0), mode: field(1), uid: field(2), gid: field(3), nlink: field(4), mtime: field(5),
			rmajor: field(9), rminor: field(10)}
		size, namesize := int(field(6)), int(field(11))
		if field(12) != 0 {
			t.Fatal("check field set")
		}
		nameStart := off + 110
		r.name = string(raw[nameStart : nameStart+namesize-1])
		if raw[nameStart+namesize-1] != 0 {
			t.Fatalf("%s: name not NUL-terminated", r.name)
		}
		dataStart := align(nameStart + namesize)
		r.data = raw[dataStart : dataStart+size]
		off = align(dataStart + size)
		if r.name == "TRAILER!!!" {
			if off != len(raw) {
				t.Fatalf("%d bytes after the trailer", len(raw)-off)
			}
			return recs
		}
		recs = append(recs, r)
	}
}

// fakeModule writes a minimal ELF relocatable whose .modinfo names its dependencies,
// which is all mkinitramfs reads from a module.
func fakeModule(t *testing.T, path, depends string) {
	t.Helper()
	modinfo := []byte("license=GPL\x00depends=" + depends + "\x00name=" + moduleName(path) + "\x00")
	shstrtab := []byte("\x00.modinfo\x00.shstrtab\x00")
	modinfoOff := uint64(64)
	shstrOff := modinfoOff + uint64(len(modinfo))
	shOff := (shstrOff + uint64(len(shstrtab)) + 7) &^ 7
	var b bytes.Buffer
	hdr := elf.Header64{
		Type: uint16(elf.ET_REL), Machine: uint16(elf.EM_X86_64), Version: uint32(elf.EV_CURRENT),
		Shoff: shOff, Ehsize: 64, Shentsize: 64, Shnum: 3, Shstrndx: 2,
	}
	copy(hdr.Ident[:], "\x7fELF")
	hdr.Ident[elf.EI_CLASS] = byte(elf.ELFCLASS64)
	hdr.Ident[elf.EI_DATA] = byte(elf.ELFDATA2LSB)
	hdr.Ident[elf.EI_VERSION] = byte(elf.EV_CURRENT)
	binary.Write(&b, binary.LittleEndian, hdr)
	b.Write(modinfo)
	b.Write(shstrtab)
	b.Write(make([]byte, int(shOff)-b.Len()))
	for _, s := range []elf.Section64{
		{},
		{Name: 1, Type: uint32(elf.SHT_PROGBITS), Off: modinfoOff, Size: uint64(len(modinfo)), Addralign: 1},
		{Name: 10, Type: uint32(elf.SHT_STRTAB), Off: shstrOff, Size: uint64(len(shstrtab)), Addralign: 1},
	} {
		binary.Write(&b, binary.LittleEndian, s)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

// fixture lays out an init, a busybox and a kernel-like module tree.
func fixture(t *testing.T) (config, string) {
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(content), 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	kdir := filepath.Join(dir, "lib/modules/6.1.0-test")
	fakeModule(t, filepath.Join(kdir, "kernel/drivers/virtio/virtio_ring.ko"), "")
	fakeModule(t, filepath.Join(kdir, "kernel/drivers/virtio/virtio.ko"), "virtio_ring")
	fakeModule(t, filepath.Join(kdir, "kernel/drivers/virtio/virtio_pci.ko"), "virtio_ring,virtio")
	fakeModule(t, filepath.Join(kdir, "kernel/drivers/char/hw_random/virtio-rng.ko"), "virtio,virtio_ring,rng_core")
	fakeModule(t, filepath.Join(kdir, "kernel/drivers/input/evdev.ko"), "")
	fakeModule(t, filepath.Join(kdir, "kernel/unused/unused.ko"), "")
	write("lib/modules/6.1.0-test/modules.builtin", "kernel/drivers/char/hw_random/rng-core.ko\n")
	order := write("order.txt", "# test\nvirtio_pci\nvirtio-rng\n")
	return config{
		init:        write("vm-agent", "\x7fELF init"),
		busybox:     write("busybox", "\x7fELF busybox"),
		applets:     []string{"sh", "ls"},
		modules:     kdir,
		moduleOrder: order,
		load:        []string{"evdev"},
	}, dir
}

func TestArchive(t *testing.T) {
	c, dir := fixture(t)
	out := filepath.Join(dir, "initrd")
	if err := run(c, out); err != nil {
		t.Fatal(err)
	}
	gz, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	recs := readArchive(t, gz)
	byName := map[string]record{}
	var names []string
	for i, r := range recs {
		if r.uid != 0 || r.gid != 0 || r.mtime != 0 {
			t.Errorf("%s: uid %d gid %d mtime %d", r.name, r.uid, r.gid, r.mtime)
		}
		if r.ino != uint32(i+1) {
			t.Errorf("%s: inode %d, want %d", r.name, r.ino, i+1)
		}
		byName[r.name] = r
		names = append(names, r.name)
	}
	if !sort.StringsAreSorted(names) {
		t.Errorf("entries not sorted: %q", names)
	}
	check := func(name string, mode uint32, data string) {
		t.Helper()
		r, ok := byName[name]
		if !ok {
			t.Errorf("%s missing", name)
			return
		}
		if r.mode != mode {
			t.Errorf("%s: mode %o, want %o", name, r.mode, mode)
		}
		if data != "" && string(r.data) != data {
			t.Errorf("%s: data %q, want %q", name, r.data, data)
		}
	}
	for _, d := range []string{"bin", "dev", "etc", "lib", "lib/modules", "proc", "run", "sbin", "sys"} {
		check(d, 0o40755, "")
		if byName[d].nlink != 2 {
			t.Errorf("%s: nlink %d", d, byName[d].nlink)
		}
	}
	check("root", 0o40700, "")
	check("tmp", 0o41777, "")
	check("init", 0o100755, "\x7fELF init")
	check("bin/busybox", 0o100755, "\x7fELF busybox")
	check("bin/sh", 0o120777, "busybox")
	check("bin/ls", 0o120777, "busybox")
	check("bin/vm-agent", 0o120777, "/init")
	check("dev/console", 0o20600, "")
	if r := byName["dev/console"]; r.rmajor != 5 || r.rminor != 1 || len(r.data) != 0 {
		t.Errorf("dev/console: %d:%d, %d bytes", r.rmajor, r.rminor, len(r.data))
	}
	check("lib/modules/modules.load", 0o100644,
		"# load order, written by mkinitramfs\nvirtio_ring.ko\nvirtio.ko\nvirtio_pci.ko\nvirtio-rng.ko\nevdev.ko\n")
	for _, m := range []string{"virtio_ring", "virtio", "virtio_pci", "virtio-rng", "evdev"} {
		check("lib/modules/"+m+".ko", 0o100644, "")
	}
	for _, absent := range []string{"lib/modules/unused.ko", "bin/poweroff", "sbin/init"} {
		if _, ok := byName[absent]; ok {
			t.Errorf("%s should not be in the archive", absent)
		}
	}
}

func TestDeterministic(t *testing.T) {
	c, dir := fixture(t)
	var outs [][]byte
	for i := range 2 {
		out := filepath.Join(dir, fmt.Sprintf("initrd.%d", i))
		if err := run(c, out); err != nil {
			t.Fatal(err)
		}
		b, _ := os.ReadFile(out)
		outs = append(outs, b)
		// Different file times must not matter.
		now := time.Now().Add(time.Hour)
		os.Chtimes(c.init, now, now)
	}
	if !bytes.Equal(outs[0], outs[1]) {
		t.Fatal("two runs produced different archives")
	}
}

func TestModuleErrors(t *testing.T) {
	c, dir := fixture(t)
	out := filepath.Join(dir, "initrd")

	missing := c
	missing.load = []string{"nonexistent"}
	if err := run(missing, out); err == nil || !strings.Contains(err.Error(), "nonexistent") {
		t.Errorf("missing module: %v", err)
	}

	fakeModule(t, filepath.Join(c.modules, "kernel/x/needy.ko"), "absent_dep")
	needy := c
	needy.load = []string{"needy"}
	if err := run(needy, out); err == nil || !strings.Contains(err.Error(), "absent_dep") {
		t.Errorf("missing dependency: %v", err)
	}

	os.WriteFile(filepath.Join(c.modules, "kernel/x/packed.ko.xz"), []byte("xz"), 0o644)
	if err := run(c, out); err == nil || !strings.Contains(err.Error(), "compressed") {
		t.Errorf("compressed module: %v", err)
	}
}

func TestModuleList(t *testing.T) {
	c, dir := fixture(t)
	// A comma-separated file list instead of a directory; no order: all, deps first.
	c.modules = strings.Join([]string{
		filepath.Join(c.modules, "kernel/drivers/virtio/virtio.ko"),
		filepath.Join(c.modules, "kernel/drivers/virtio/virtio_ring.ko"),
	}, ",")
	c.moduleOrder, c.load = "", nil
	out := filepath.Join(dir, "initrd")
	if err := run(c, out); err != nil {
		t.Fatal(err)
	}
	gz, _ := os.ReadFile(out)
	for _, r := range readArchive(t, gz) {
		if r.name == "lib/modules/modules.load" {
			if !strings.HasSuffix(string(r.data), "\nvirtio_ring.ko\nvirtio.ko\n") {
				t.Fatalf("order %q", r.data)
			}
			return
		}
	}
	t.Fatal("no modules.load")
}
