// Command mkinitramfs writes the test guest's initramfs: a deterministic gzip-compressed
// newc cpio with vm-agent as /init, busybox, and kernel modules in load order.
package main

import (
	"bytes"
	"compress/gzip"
	"flag"
	"fmt"
	"github.com/giantswarm/vm-manager/guest/internal/initsys"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"

	"github.com/giantswarm/vm-manager/guest/internal/cpio"
)

// defaultApplets get /bin symlinks to busybox. poweroff, reboot, halt and init are
// left out on purpose: vm-agent is init and owns power-off.
var defaultApplets = strings.Fields(`
	[ ash awk basename cat chmod cp cpio cut date dd df dirname dmesg du echo env false
	find free grep head hexdump hostname id ifconfig insmod ip kill less ln ls lsmod
	mkdir mknod modinfo mount mv nc netstat nslookup od ping printf ps pwd readlink
	realpath rm rmdir rmmod route sed sh sha256sum sleep sort stat sync tail tee test
	top touch tr true udhcpc umount uname uniq uptime vi watch wc wget which xargs xxd`)

// baseDirs always exist in the archive.
var baseDirs = []string{"bin", "dev", "etc", "lib", "lib/modules", "proc", "root", "run", "sbin", "sys", "tmp"}

type config struct {
	init        string
	busybox     string
	applets     []string
	modules     string
	moduleOrder string
	load        []string
}

func main() {
	var c config
	out := flag.String("o", "", "output file (gzip-compressed newc cpio)")
	flag.StringVar(&c.init, "init", "", "the /init binary (vm-agent)")
	flag.StringVar(&c.busybox, "busybox", "", "static busybox binary for /bin/busybox (optional)")
	applets := flag.String("applets", strings.Join(defaultApplets, ","), "comma-separated busybox applets to link in /bin")
	flag.StringVar(&c.modules, "modules", "", "directory searched for .ko files (e.g. lib/modules/<kver>), or a comma-separated list of .ko files")
	flag.StringVar(&c.moduleOrder, "module-order", "", "file naming the modules to include and load, one per line; dependencies are added from .modinfo")
	load := flag.String("load", "", "comma-separated module names, after those of -module-order")
	flag.Parse()
	if *out == "" || c.init == "" || flag.NArg() > 0 {
		flag.Usage()
		os.Exit(2)
	}
	c.applets = splitList(*applets)
	c.load = splitList(*load)
	if err := run(c, *out); err != nil {
		fmt.Fprintln(os.Stderr, "mkinitramfs:", err)
		os.Exit(1)
	}
}

func splitList(s string) []string {
	var l []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			l = append(l, f)
		}
	}
	return l
}

func run(c config, out string) error {
	entries, loaded, err := collect(c)
	if err != nil {
		return err
	}
	data, err := archive(entries)
	if err != nil {
		return err
	}
	// Write next to the target and rename, so readers never see half an archive.
	tmp, err := os.CreateTemp(filepath.Dir(out), ".mkinitramfs-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), out); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "mkinitramfs: %s: %d entries, %d bytes, modules: %s\n", out, len(entries), len(data), strings.Join(loaded, " "))
	return nil
}

// collect gathers the archive's entries, keyed by name.
func collect(c config) (map[string]cpio.Entry, []string, error) {
	entries := map[string]cpio.Entry{}
	add := func(e cpio.Entry) { entries[e.Name] = e }
	for _, d := range baseDirs {
		add(cpio.Dir(d, 0o755))
	}
	add(cpio.Dir("root", 0o700))
	add(cpio.Dir("tmp", 0o1777))
	// The kernel opens /dev/console for init before anything can mknod it.
	add(cpio.CharDev("dev/console", 0o600, 5, 1))
	add(cpio.File("etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/bin/sh\n")))
	add(cpio.File("etc/group", 0o644, []byte("root:x:0:\n")))

	initBin, err := os.ReadFile(c.init)
	if err != nil {
		return nil, nil, err
	}
	add(cpio.File("init", 0o755, initBin))
	// So a shell in the guest can run the CLI: vm-agent notify, vm-agent version.
	add(cpio.Symlink("bin/vm-agent", "/init"))

	if c.busybox != "" {
		bb, err := os.ReadFile(c.busybox)
		if err != nil {
			return nil, nil, err
		}
		add(cpio.File("bin/busybox", 0o755, bb))
		for _, a := range c.applets {
			if strings.Contains(a, "/") || a == "busybox" {
				return nil, nil, fmt.Errorf("bad applet name %q", a)
			}
			add(cpio.Symlink("bin/"+a, "busybox"))
		}
	}

	var loaded []string
	if c.modules != "" {
		want, err := wantedModules(c)
		if err != nil {
			return nil, nil, err
		}
		index, builtin, err := findModules(c.modules)
		if err != nil {
			return nil, nil, err
		}
		order, err := resolveOrder(want, index, builtin, modinfoDepends)
		if err != nil {
			return nil, nil, err
		}
		var list bytes.Buffer
		list.WriteString("# load order, written by mkinitramfs\n")
		for _, m := range order {
			b, err := os.ReadFile(m.path)
			if err != nil {
				return nil, nil, err
			}
			file := filepath.Base(m.path)
			if _, dup := entries["lib/modules/"+file]; dup {
				return nil, nil, fmt.Errorf("two modules named %s", file)
			}
			add(cpio.File("lib/modules/"+file, 0o644, b))
			list.WriteString(file + "\n")
			loaded = append(loaded, m.name)
		}
		add(cpio.File("lib/modules/modules.load", 0o644, list.Bytes()))
	} else if c.moduleOrder != "" || len(c.load) > 0 {
		return nil, nil, fmt.Errorf("-module-order and -load need -modules")
	}

	// Every parent directory exists as an entry.
	for name := range entries {
		for d := path.Dir(name); d != "."; d = path.Dir(d) {
			if _, ok := entries[d]; !ok {
				add(cpio.Dir(d, 0o755))
			}
		}
	}
	return entries, loaded, nil
}

func wantedModules(c config) ([]string, error) {
	var want []string
	if c.moduleOrder != "" {
		names, err := initsys.ReadModuleOrder(c.moduleOrder)
		if err != nil {
			return nil, err
		}
		want = append(want, names...)
	}
	return append(want, c.load...), nil
}

// archive writes the entries sorted by name (parents sort before their children),
// with inode numbers in that order, and gzips the result with a zero header time.
func archive(entries map[string]cpio.Entry) ([]byte, error) {
	names := make([]string, 0, len(entries))
	for n := range entries {
		names = append(names, n)
	}
	sort.Strings(names)
	var buf bytes.Buffer
	zw, err := gzip.NewWriterLevel(&buf, gzip.BestCompression)
	if err != nil {
		return nil, err
	}
	w := cpio.NewWriter(zw)
	for _, n := range names {
		if err := w.WriteEntry(entries[n]); err != nil {
			return nil, err
		}
	}
	if err := w.Close(); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
