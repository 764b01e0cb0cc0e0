package driver

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// A forked disk's chain, built as Snapshot and PrepareFork build it, with
// the real qemu-img: the layers name each other by base name, so the
// fork's links read the same chain, and deleting the parent's directory
// leaves the fork's disk whole (qemu-img check reads every layer).
func TestForkDiskChain(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("qemu-img is missing (qemu-utils)")
		}
		t.Skip("no qemu-img (qemu-utils)")
	}
	ctx := context.Background()
	d := &Driver{}
	parent, child, grandchild := t.TempDir(), t.TempDir(), t.TempDir()
	base := filepath.Join(parent, "disk.raw")
	if err := os.WriteFile(base, []byte("the parent's data"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(base, 64<<20); err != nil {
		t.Fatal(err)
	}
	if chain, err := diskChain(base); err != nil || len(chain) != 1 || chain[0] != base {
		t.Fatalf("a raw disk's chain: %v %v", chain, err)
	}

	// The parent's snapshot: a new active layer over the frozen raw disk.
	frozen, _ := diskChain(base)
	parentTop := filepath.Join(parent, newLayerName())
	if err := d.createOverlay(ctx, parentTop, base); err != nil {
		t.Fatal(err)
	}
	if chain, err := diskChain(parentTop); err != nil || len(chain) != 2 || chain[0] != base {
		t.Fatalf("the parent's chain: %v %v", chain, err)
	}
	if n, err := diskSize(parentTop); err != nil || n != 64<<20 {
		t.Fatalf("overlay size %d %v", n, err)
	}

	// The fork: links of the frozen layers and an overlay of its own.
	top, err := linkChain(frozen, child)
	if err != nil {
		t.Fatal(err)
	}
	childTop := filepath.Join(child, newLayerName())
	if err := d.createOverlay(ctx, childTop, top); err != nil {
		t.Fatal(err)
	}
	// A fork of the fork: its frozen chain has two layers.
	frozen2, err := diskChain(childTop)
	if err != nil || len(frozen2) != 2 {
		t.Fatalf("the fork's chain: %v %v", frozen2, err)
	}
	top2, err := linkChain(frozen2, grandchild)
	if err != nil {
		t.Fatal(err)
	}
	gTop := filepath.Join(grandchild, newLayerName())
	if err := d.createOverlay(ctx, gTop, top2); err != nil {
		t.Fatal(err)
	}

	if err := os.RemoveAll(parent); err != nil {
		t.Fatal(err)
	}
	for _, top := range []string{childTop, gTop} {
		out, err := exec.Command("qemu-img", "check", top).CombinedOutput()
		if err != nil {
			t.Errorf("qemu-img check %s after the parent's deletion: %v: %s", top, err, out)
		}
		out, err = exec.Command("qemu-img", "info", "--backing-chain", top).CombinedOutput()
		if err != nil || strings.Count(string(out), "image: ") != len(mustChain(t, top)) {
			t.Errorf("qemu-img info --backing-chain %s: %v: %s", top, err, out)
		}
	}
	// The base's bytes, read through the grandchild's chain.
	raw := filepath.Join(t.TempDir(), "flat.raw")
	if out, err := exec.Command("qemu-img", "convert", "-O", "raw", gTop, raw).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img convert: %v: %s", err, out)
	}
	if b, _ := os.ReadFile(raw); !strings.HasPrefix(string(b), "the parent's data") {
		t.Errorf("the grandchild's disk does not read the parent's data: %q", b[:32])
	}
}

func mustChain(t *testing.T, top string) []string {
	t.Helper()
	c, err := diskChain(top)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// A layer naming a backing file outside its directory is refused: a
// chain is followed only among the VM's own files.
func TestForkDiskChainRefusesForeignBacking(t *testing.T) {
	if _, err := exec.LookPath("qemu-img"); err != nil {
		t.Skip("no qemu-img (qemu-utils)")
	}
	dir := t.TempDir()
	for _, backing := range []string{"/etc/passwd", "../x.raw"} {
		p := filepath.Join(dir, newLayerName())
		if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", backing, "-u", p, "1M").CombinedOutput(); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		if _, err := diskChain(p); err == nil || !strings.Contains(err.Error(), "not a layer in its directory") {
			t.Errorf("backing %q: %v", backing, err)
		}
	}
}
