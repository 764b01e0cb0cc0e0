package driver

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/qemu"
)

// A VM's disk is a chain of files in its own directory: the raw disk it was
// created with, then, once it has been forked, qcow2 overlays, each naming
// the one below by its base name. A fork freezes the parent's active layer
// (the parent goes on in a new overlay) and each fork gets hard links of the
// frozen chain in its directory plus an overlay of its own: copy-on-write,
// no copy, and deleting any VM's directory leaves the others' links. Layer
// names are random, so links from several generations never collide.

// maxChain bounds a disk chain's length: each fork generation adds a layer,
// and a corrupt header must not loop.
const maxChain = 64

// qcow2Header is what the disk code reads of a qcow2 file's header.
type qcow2Header struct {
	backing string // "" without a backing file
	size    int64  // virtual size
}

// readQcow2 reads path's header; ok is false for a file that is not qcow2.
func readQcow2(path string) (h qcow2Header, ok bool, err error) {
	f, err := os.Open(path)
	if err != nil {
		return h, false, err
	}
	defer f.Close()
	var hdr [32]byte
	if _, err := io.ReadFull(f, hdr[:]); err != nil {
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			return h, false, nil
		}
		return h, false, err
	}
	if string(hdr[:4]) != "QFI\xfb" {
		return h, false, nil
	}
	off, n := binary.BigEndian.Uint64(hdr[8:16]), binary.BigEndian.Uint32(hdr[16:20])
	h.size = int64(binary.BigEndian.Uint64(hdr[24:32]))
	if off == 0 || n == 0 {
		return h, true, nil
	}
	if n > 1023 {
		return h, true, fmt.Errorf("%s: backing file name of %d bytes", path, n)
	}
	name := make([]byte, n)
	if _, err := f.ReadAt(name, int64(off)); err != nil {
		return h, true, fmt.Errorf("%s: backing file name: %w", path, err)
	}
	h.backing = string(name)
	return h, true, nil
}

// diskChain lists the files of the disk whose active layer is top, base
// first. Every layer must be in top's directory, named by its base name.
func diskChain(top string) ([]string, error) {
	dir := filepath.Dir(top)
	chain := []string{top}
	for cur := top; ; {
		h, isQcow2, err := readQcow2(cur)
		if err != nil {
			return nil, err
		}
		if !isQcow2 || h.backing == "" {
			break
		}
		if h.backing != filepath.Base(h.backing) || strings.HasPrefix(h.backing, ".") {
			return nil, fmt.Errorf("%s: backing file %q is not a layer in its directory", cur, h.backing)
		}
		if len(chain) == maxChain {
			return nil, fmt.Errorf("%s: disk chain longer than %d layers", top, maxChain)
		}
		cur = filepath.Join(dir, h.backing)
		chain = append([]string{cur}, chain...)
	}
	return chain, nil
}

// diskSize is the virtual size of the disk layer at path.
func diskSize(path string) (int64, error) {
	h, isQcow2, err := readQcow2(path)
	if err != nil {
		return 0, err
	}
	if isQcow2 {
		return h.size, nil
	}
	fi, err := os.Stat(path)
	if err != nil {
		return 0, err
	}
	return fi.Size(), nil
}

// newLayerName is a fresh overlay's base name.
func newLayerName() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return "disk-" + hex.EncodeToString(b) + ".qcow2"
}

// createOverlay writes an empty qcow2 overlay at path over the layer
// backing (a path in the same directory), of the same virtual size. -u: the
// backing layer may be open, and locked, by the VM's QEMU.
func (d *Driver) createOverlay(ctx context.Context, path, backing string) error {
	if filepath.Dir(path) != filepath.Dir(backing) {
		return fmt.Errorf("overlay %s and its backing file %s are in different directories", path, backing)
	}
	size, err := diskSize(backing)
	if err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, d.qemuImg(), "create", "-q", "-f", "qcow2",
		"-F", qemu.VolumeFormat(backing), "-b", filepath.Base(backing), "-u", path, strconv.FormatInt(size, 10)).CombinedOutput()
	if err != nil {
		_ = os.Remove(path)
		return fmt.Errorf("qemu-img create %s: %v: %s", filepath.Base(path), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// qemuImg is the qemu-img binary: the configured one, else the one beside
// the QEMU binary, else qemu-img on PATH.
func (d *Driver) qemuImg() string {
	if d.cfg.QEMUImgBinary != "" {
		return d.cfg.QEMUImgBinary
	}
	if dir := filepath.Dir(d.cfg.QEMUBinary); dir != "." {
		if p := filepath.Join(dir, "qemu-img"); fileExists(p) {
			return p
		}
	}
	return "qemu-img"
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// linkChain hard-links the layers of chain into dir under their base names
// and returns the active (last) layer's link.
func linkChain(chain []string, dir string) (string, error) {
	var top string
	for _, l := range chain {
		top = filepath.Join(dir, filepath.Base(l))
		if err := os.Link(l, top); err != nil {
			return "", fmt.Errorf("link the parent's disk layer: %w", err)
		}
	}
	return top, nil
}

// copyVars copies a firmware variable store (a few hundred KiB) over dst.
func copyVars(src, dst string) error {
	b, err := os.ReadFile(src)
	if err != nil {
		return err
	}
	return os.WriteFile(dst, b, 0o600)
}
