package installer

import (
	"bytes"
	"crypto/rand"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const targetCred = "/dev/disk/by-id/virtio-target"

// machine is a fake /sys and /dev with two "disks" that are temp files: vda
// (serial installer) and vdb (serial target).
type machine struct {
	sys, dev string
	src      []byte
}

func newMachine(t *testing.T, srcSize, dstSize int) *machine {
	t.Helper()
	root := t.TempDir()
	m := &machine{sys: filepath.Join(root, "sys"), dev: filepath.Join(root, "dev"), src: make([]byte, srcSize)}
	rand.Read(m.src)
	for name, serial := range map[string]string{"vda": SourceSerial, "vdb": "target", "vdc": "other"} {
		d := filepath.Join(m.sys, "block", name)
		must(t, os.MkdirAll(d, 0o755))
		must(t, os.WriteFile(filepath.Join(d, "serial"), []byte(serial+"\n"), 0o444))
	}
	must(t, os.MkdirAll(m.dev, 0o755))
	must(t, os.WriteFile(filepath.Join(m.dev, "vda"), m.src, 0o444))
	must(t, os.WriteFile(filepath.Join(m.dev, "vdb"), bytes.Repeat([]byte{0xee}, dstSize), 0o644))
	must(t, os.WriteFile(filepath.Join(m.dev, "vdc"), nil, 0o644))
	return m
}

func (m *machine) config(logs *[]string) Config {
	return Config{Target: targetCred, SysRoot: m.sys, DevRoot: m.dev, Logf: func(f string, a ...any) {
		if logs != nil {
			*logs = append(*logs, f)
		}
	}}
}

func (m *machine) target(t *testing.T) []byte {
	b, err := os.ReadFile(filepath.Join(m.dev, "vdb"))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func TestInstallCopies(t *testing.T) {
	// Not a multiple of the chunk: the last chunk is partial. Two chunks of
	// zeros in the middle are zeroed, not written, over a target that
	// held other bytes there.
	m := newMachine(t, 4*chunk+12345, 6*chunk)
	clear(m.src[chunk : 3*chunk])
	must(t, os.WriteFile(filepath.Join(m.dev, "vda"), m.src, 0o444))
	var logs []string
	r, err := Run(m.config(&logs))
	if err != nil {
		t.Fatal(err)
	}
	got := m.target(t)
	if len(got) != 6*chunk {
		t.Fatalf("target resized to %d", len(got))
	}
	if !bytes.Equal(got[:len(m.src)], m.src) {
		t.Error("target's first bytes differ from the source")
	}
	if !bytes.Equal(got[len(m.src):], bytes.Repeat([]byte{0xee}, len(got)-len(m.src))) {
		t.Error("bytes past the source's end were touched")
	}
	if r.SourceSize != int64(len(m.src)) || r.TargetSize != 6*chunk || r.Zeroed != 2*chunk || r.Written != r.SourceSize-2*chunk ||
		r.Source != filepath.Join(m.dev, "vda") || r.Target != filepath.Join(m.dev, "vdb") {
		t.Errorf("result %+v", r)
	}
	if len(logs) != 2 {
		t.Errorf("console lines %q", logs)
	}
}

func TestInstallRefusesSmallerTarget(t *testing.T) {
	m := newMachine(t, chunk+1, chunk)
	_, err := Run(m.config(nil))
	if err == nil || !strings.Contains(err.Error(), "is larger than target") {
		t.Fatalf("err %v", err)
	}
	if !bytes.Equal(m.target(t), bytes.Repeat([]byte{0xee}, chunk)) {
		t.Error("target written although the install was refused")
	}
}

// shortDisk writes half of what it is given without an error, as a failing
// device might. (A copy that is wrong without any error is the host's to
// find: it compares the volume with the image.)
type shortDisk struct{ *os.File }

func (b *shortDisk) WriteAt(p []byte, off int64) (int, error) {
	return b.File.WriteAt(p[:len(p)/2], off)
}

func breakTarget(m *machine) func(string, int) (File, error) {
	return func(p string, flag int) (File, error) {
		f, err := os.OpenFile(p, flag, 0)
		if err != nil || p != filepath.Join(m.dev, "vdb") {
			return f, err
		}
		return &shortDisk{File: f}, nil
	}
}

func TestInstallDetectsShortWrite(t *testing.T) {
	m := newMachine(t, chunk+100, 2*chunk)
	c := m.config(nil)
	c.Open = breakTarget(m)
	_, err := Run(c)
	if !errors.Is(err, io.ErrShortWrite) {
		t.Fatalf("err %v", err)
	}
}

func TestInstallBadTargets(t *testing.T) {
	m := newMachine(t, 1000, 2000)
	for cred, want := range map[string]string{
		"/dev/vdb":                         "want /dev/disk/by-id/virtio-<serial>",
		"/dev/disk/by-id/virtio-":          "want /dev/disk/by-id/virtio-<serial>",
		"/dev/disk/by-id/virtio-a/b":       "want /dev/disk/by-id/virtio-<serial>",
		"/dev/disk/by-id/virtio-installer": "names the installer disk itself",
		"/dev/disk/by-id/virtio-missing":   `no disk with serial "missing"`,
		"/dev/disk/by-id/virtio-other":     "is larger than target", // vdc is empty
	} {
		c := m.config(nil)
		c.Target = cred
		_, err := Run(c)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: err %v, want %q", cred, err, want)
		}
	}
}

// Disks that show up late are waited for, up to Wait.
func TestInstallWaitsForDisks(t *testing.T) {
	m := newMachine(t, 1000, 2000)
	must(t, os.Rename(filepath.Join(m.dev, "vdb"), filepath.Join(m.dev, "vdb.late")))
	c := m.config(nil)
	now := time.Unix(0, 0)
	c.Now = func() time.Time { return now }
	slept := 0
	c.Sleep = func(d time.Duration) {
		now = now.Add(d)
		if slept++; slept == 3 && c.Target == targetCred {
			must(t, os.Rename(filepath.Join(m.dev, "vdb.late"), filepath.Join(m.dev, "vdb")))
		}
	}
	c.Wait = time.Second
	if _, err := Run(c); err != nil || slept != 3 {
		t.Fatalf("err %v after %d sleeps", err, slept)
	}
	c.Target = "/dev/disk/by-id/virtio-missing"
	slept = 0
	if _, err := Run(c); err == nil || slept != 10 {
		t.Fatalf("err %v after %d sleeps", err, slept)
	}
}
