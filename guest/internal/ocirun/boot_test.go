package ocirun

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/giantswarm/vm-manager/pkg/ociboot"
	"github.com/giantswarm/vm-manager/pkg/verity"
)

// fakeDisks makes sysfs entries block/vd?/serial and the "disks" as files.
func fakeDisks(t *testing.T, disks map[string][]byte) (sys, dev string) {
	sys, dev = t.TempDir(), t.TempDir()
	i := 0
	for serial, content := range disks {
		name := fmt.Sprintf("vd%c", 'a'+i)
		i++
		os.MkdirAll(filepath.Join(sys, "block", name), 0o755)
		os.WriteFile(filepath.Join(sys, "block", name, "serial"), []byte(serial+"\n"), 0o444)
		os.WriteFile(filepath.Join(dev, name), content, 0o600)
	}
	return sys, dev
}

type bootLog struct {
	mu       sync.Mutex
	lines    []string
	measured []string
}

func (l *bootLog) opts(sys, dev, cmdline string) Options {
	return Options{
		Cmdline: cmdline, SysRoot: sys, DevRoot: dev, Dir: filepath.Join(dev, "oci"), DiskWait: time.Millisecond,
		Logf: func(f string, a ...any) {
			l.mu.Lock()
			l.lines = append(l.lines, fmt.Sprintf(f, a...))
			l.mu.Unlock()
		},
		Measure: func(pcr uint32, word, eventType string) error {
			l.measured = append(l.measured, fmt.Sprintf("%d %s %s", pcr, eventType, word))
			return nil
		},
	}
}

func (l *bootLog) has(prefix string) bool {
	for _, line := range l.lines {
		if strings.HasPrefix(line, prefix) {
			return true
		}
	}
	return false
}

// testRoot is a root of n blocks and its command line.
func testRoot(t *testing.T, n int) ([]byte, ociboot.Root) {
	data := make([]byte, n*ociboot.BlockSize)
	for i := range data {
		data[i] = byte(i * 7)
	}
	r := ociboot.Root{Salt: []byte("salt"), DataBlocks: uint64(n)}
	var err error
	if r.RootHash, err = verity.Format(bytes.NewReader(data), int64(len(data)), io.Discard, verity.Params{Salt: r.Salt}); err != nil {
		t.Fatal(err)
	}
	return data, r
}

func TestBootWithoutOCIWords(t *testing.T) {
	var l bootLog
	if named, r := Boot(l.opts(t.TempDir(), t.TempDir(), "console=ttyS0 panic=-1")); named || r != nil || len(l.lines) != 0 {
		t.Errorf("named %v root %v lines %q", named, r, l.lines)
	}
}

func TestBootRefusals(t *testing.T) {
	data, root := testRoot(t, 5)
	flipped := bytes.Clone(data)
	flipped[3*ociboot.BlockSize+17] ^= 1
	all := func(d []byte) map[string][]byte {
		return map[string][]byte{ociboot.SerialRoot: d, ociboot.SerialVerity: {0}, ociboot.SerialUpper: nil}
	}
	other := root
	other.Salt = []byte("pepper") // the same blocks, hashed with another salt
	for _, c := range []struct {
		name, cmdline string
		disks         map[string][]byte
		want          string
		measured      bool
	}{
		{"partial command line", "vmm.oci.roothash=" + hex.EncodeToString(root.RootHash), all(data),
			"OCI root refused: the command line names an OCI root partly", false},
		{"bad hex", "vmm.oci.roothash=zz vmm.oci.salt=00 vmm.oci.datablocks=1", all(data),
			"OCI root refused: vmm.oci.roothash: not 32 bytes of hex: not mounting it", false},
		{"no verity disk", root.Cmdline(), map[string][]byte{ociboot.SerialRoot: data, ociboot.SerialUpper: nil},
			`OCI root refused: disk "oci-verity": no disk with serial "oci-verity"`, false},
		{"short disk", root.Cmdline(), all(data[:4*ociboot.BlockSize]),
			"OCI root refused: ", false},
		{"a flipped bit", root.Cmdline(), all(flipped),
			"OCI root refused: verity root hash ", true},
		{"another salt", other.Cmdline(), all(data),
			"OCI root refused: verity root hash ", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			var l bootLog
			sys, dev := fakeDisks(t, c.disks)
			named, r := Boot(l.opts(sys, dev, c.cmdline))
			if !named || r != nil || !l.has(c.want) {
				t.Errorf("named %v root %v, lines %q; want a line starting %q", named, r, l.lines, c.want)
			}
			if c.measured != (len(l.measured) == 1) {
				t.Errorf("measured %q", l.measured)
			}
			if _, err := os.Stat(filepath.Join(dev, "oci")); err == nil {
				t.Error("a refused root got its directories")
			}
		})
	}
}

// The computed hash is measured, before the comparison, and a mismatch
// line names both.
func TestBootMeasuresTheComputedHash(t *testing.T) {
	data, root := testRoot(t, 3)
	got := hex.EncodeToString(root.RootHash)
	want := bytes.Repeat([]byte{0x11}, 32)
	root.RootHash = want
	var l bootLog
	sys, dev := fakeDisks(t, map[string][]byte{ociboot.SerialRoot: data, ociboot.SerialVerity: {0}, ociboot.SerialUpper: nil})
	Boot(l.opts(sys, dev, root.Cmdline()))
	if m := fmt.Sprintf("15 %s %s", measure.EventTypeVerityRoot, measure.VerityRootWord(got)); len(l.measured) != 1 || l.measured[0] != m {
		t.Errorf("measured %q, want %q", l.measured, m)
	}
	line := fmt.Sprintf("OCI root refused: verity root hash %s is not the command line's %x: not mounting it", got, want)
	if !l.has(line) {
		t.Errorf("lines %q lack %q", l.lines, line)
	}
}

// A matching root goes on to device-mapper, which needs block devices:
// with files it fails, after measuring, and says so.
func TestBootMatchingRootFailsOnFiles(t *testing.T) {
	data, root := testRoot(t, 3)
	var l bootLog
	sys, dev := fakeDisks(t, map[string][]byte{ociboot.SerialRoot: data, ociboot.SerialVerity: {0}, ociboot.SerialUpper: nil})
	named, r := Boot(l.opts(sys, dev, root.Cmdline()))
	if !named || r != nil || len(l.measured) != 1 || !l.has("OCI root failed: ") || !strings.HasSuffix(l.lines[len(l.lines)-1], "is not a block device: not running it") {
		t.Errorf("named %v root %v measured %q lines %q", named, r, l.measured, l.lines)
	}
}

func TestRootHashReadsOnlyDataBlocks(t *testing.T) {
	data, root := testRoot(t, 2)
	f := filepath.Join(t.TempDir(), "disk")
	// A disk larger than the root (a host rounds disks up): the tail is not hashed.
	os.WriteFile(f, append(bytes.Clone(data), bytes.Repeat([]byte{0xff}, 3*ociboot.BlockSize)...), 0o600)
	got, err := RootHash(f, root)
	if err != nil || !bytes.Equal(got, root.RootHash) {
		t.Errorf("RootHash = %x, %v; want %x", got, err, root.RootHash)
	}
}

func TestHasExt(t *testing.T) {
	head := make([]byte, 2048)
	if hasExt(head) || !allZero(head) {
		t.Error("zeros")
	}
	head[1024+56], head[1024+57] = 0x53, 0xef
	if !hasExt(head) || allZero(head) {
		t.Error("magic")
	}
}
