package host

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestToolOutputCache: get_host is a hot call; a program's --version and the
// firmware's package are asked once per build of the file, not per report.
func TestToolOutputCache(t *testing.T) {
	f := newFakeHost(t)
	bins := map[string]string{}
	for name := range f.tools {
		bins[name] = f.write("bin/"+name, "#!/bin/true "+name)
	}
	code := f.write("OVMF/OVMF_CODE.fd", "code")
	f.write("OVMF/OVMF_VARS.fd", "vars")
	f.dpkg["--search "+code] = "ovmf: " + code + "\n"
	f.dpkg["--show ovmf"] = "2025.02-8"
	cfg := f.config()
	cfg.LookPath = func(name string) (string, error) {
		if p, ok := bins[name]; ok {
			return p, nil
		}
		return f.lookPath(name)
	}
	failSwtpm := true
	cfg.Run = func(ctx context.Context, name string, args ...string) ([]byte, error) {
		f.mu.Lock()
		fail := failSwtpm && filepath.Base(name) == "swtpm"
		f.mu.Unlock()
		if fail {
			f.mu.Lock()
			f.calls = append(f.calls, name+" "+strings.Join(args, " "))
			f.mu.Unlock()
			return nil, errors.New("exit status 1")
		}
		return f.run(ctx, name, args...)
	}
	calls := func() []string {
		f.mu.Lock()
		defer f.mu.Unlock()
		c := slices.Clone(f.calls)
		f.calls = nil
		slices.Sort(c)
		return c
	}
	p := New(cfg)
	h := p.Report(context.Background())
	if h.Qemu.Version == "" || h.Swtpm.Error == "" || h.Firmware.Version != "2025.02-8" {
		t.Fatalf("first report: qemu %v swtpm %v firmware %v", h.Qemu, h.Swtpm, h.Firmware)
	}
	if got := calls(); len(got) != 5 {
		t.Fatalf("first report ran %q, want the three tools and two dpkg-query", got)
	}
	// A failure is not cached: swtpm is asked again, nothing else.
	f.mu.Lock()
	failSwtpm = false
	f.mu.Unlock()
	h = p.Report(context.Background())
	if got, want := calls(), []string{bins["swtpm"] + " --version"}; !slices.Equal(got, want) {
		t.Errorf("second report ran %q, want %q", got, want)
	}
	if h.Swtpm.Version == "" || h.Swtpm.Error != "" || h.Qemu.Version == "" || h.Systemd.Version == "" || h.Firmware.Package != "ovmf" || h.Firmware.Version != "2025.02-8" {
		t.Errorf("second report from the cache: qemu %v swtpm %v systemd %v firmware %v", h.Qemu, h.Swtpm, h.Systemd, h.Firmware)
	}
	if got := calls(); len(got) != 0 {
		t.Errorf("calls left over: %q", got)
	}
	h = p.Report(context.Background())
	if got := calls(); len(got) != 0 {
		t.Errorf("third report ran %q, want everything from the cache", got)
	}
	// An upgraded program (new mtime) is asked again, and so is dpkg for
	// a replaced firmware image.
	later := time.Now().Add(time.Minute)
	for _, file := range []string{bins["qemu-system-x86_64"], code} {
		if err := os.Chtimes(file, later, later); err != nil {
			t.Fatal(err)
		}
	}
	p.Report(context.Background())
	want := []string{"dpkg-query --search " + code, "dpkg-query --show --showformat=${Version} ovmf", bins["qemu-system-x86_64"] + " --version"}
	slices.Sort(want)
	if got := calls(); !slices.Equal(got, want) {
		t.Errorf("after the upgrade: ran %q, want %q", got, want)
	}
}

func TestToolVersionFailure(t *testing.T) {
	f := newFakeHost(t)
	cfg := f.config()
	cfg.Run = func(ctx context.Context, name string, args ...string) ([]byte, error) {
		if filepath.Base(name) == "swtpm" {
			<-ctx.Done() // hangs until the per-command timeout
			return nil, ctx.Err()
		}
		return f.run(ctx, name, args...)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	h := New(cfg).Report(ctx)
	if !h.Swtpm.Found || h.Swtpm.Version != "" || !strings.Contains(h.Swtpm.Error, "swtpm --version") {
		t.Errorf("swtpm = %v", h.Swtpm)
	}
}

// A fleet node's identity is reported as configured; outside a fleet no
// index is.
func TestReportNode(t *testing.T) {
	f := newFakeHost(t)
	cfg := f.config()
	i := int32(3)
	cfg.Node = Node{Name: "node-3", Index: &i, Labels: map[string]string{"zone": "a"}}
	h := New(cfg).Report(context.Background())
	if h.GetNodeName() != "node-3" || h.NodeIndex == nil || h.GetNodeIndex() != 3 || h.GetNodeLabels()["zone"] != "a" {
		t.Errorf("node fields: %q %v %v", h.GetNodeName(), h.NodeIndex, h.GetNodeLabels())
	}
	if h := New(f.config()).Report(context.Background()); h.NodeIndex != nil || h.GetNodeName() != "" {
		t.Errorf("outside a fleet: %v %q", h.NodeIndex, h.GetNodeName())
	}
}
