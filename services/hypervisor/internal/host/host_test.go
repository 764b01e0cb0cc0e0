package host

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
)

// fakeHost is a temp directory standing in for /proc, /dev, /usr/share and PATH.
type fakeHost struct {
	t    *testing.T
	root string
	// tools maps a program name to its --version output; absent = not on PATH.
	tools map[string]string
	// dpkg maps "--search <path>" / "--show <pkg>" to output; absent = failure.
	dpkg map[string]string

	mu    sync.Mutex
	calls []string
}

func newFakeHost(t *testing.T) *fakeHost {
	t.Helper()
	f := &fakeHost{
		t:    t,
		root: t.TempDir(),
		tools: map[string]string{
			"qemu-system-x86_64": "QEMU emulator version 9.2.0 (Debian 1:9.2+ds-1)\nCopyright (c) 2003-2024\n",
			"swtpm":              "TPM emulator version 0.7.1, Copyright (c) 2014-2021 IBM Corp.\n",
			"systemctl":          "systemd 257 (257.4-1)\n+PAM +AUDIT\n",
		},
		dpkg: map[string]string{},
	}
	f.write("proc/sys/kernel/osrelease", "6.12.0-test\n")
	f.write("proc/meminfo", "MemTotal:        2048 kB\nMemFree:         1024 kB\n")
	f.write("dev/kvm", "")
	f.write("dev/vhost-vsock", "")
	return f
}

func (f *fakeHost) path(rel string) string { return filepath.Join(f.root, rel) }

func (f *fakeHost) write(rel, content string) string {
	f.t.Helper()
	p := f.path(rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		f.t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		f.t.Fatal(err)
	}
	return p
}

func (f *fakeHost) lookPath(name string) (string, error) {
	if _, ok := f.tools[name]; ok {
		return "/fake/bin/" + name, nil
	}
	return "", &os.PathError{Op: "lookpath", Path: name, Err: errors.New("executable file not found in $PATH")}
}

func (f *fakeHost) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	if _, ok := ctx.Deadline(); !ok {
		f.t.Errorf("%s run without a deadline", name)
	}
	f.mu.Lock()
	f.calls = append(f.calls, name+" "+strings.Join(args, " "))
	f.mu.Unlock()
	if name == "dpkg-query" {
		key := args[0] + " " + args[len(args)-1]
		if out, ok := f.dpkg[key]; ok {
			return []byte(out), nil
		}
		return nil, errors.New("exit status 1")
	}
	if out, ok := f.tools[filepath.Base(name)]; ok && slices.Equal(args, []string{"--version"}) {
		return []byte(out), nil
	}
	return nil, errors.New("unexpected command")
}

func (f *fakeHost) config() Config {
	return Config{
		KVMPath:            f.path("dev/kvm"),
		VhostVsockPath:     f.path("dev/vhost-vsock"),
		ProcRoot:           f.path("proc"),
		StorageProviderDir: f.path("run/io.systemd.StorageProvider"),
		OVMFPairs: []OVMFPair{
			{f.path("edk2/x64/OVMF_CODE.4m.fd"), f.path("edk2/x64/OVMF_VARS.4m.fd")},
			{f.path("OVMF/OVMF_CODE_4M.fd"), f.path("OVMF/OVMF_VARS_4M.fd")},
			{f.path("OVMF/OVMF_CODE.fd"), f.path("OVMF/OVMF_VARS.fd")},
		},
		Run:      f.run,
		LookPath: f.lookPath,
	}
}

func sha(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

func TestReportHealthyHost(t *testing.T) {
	f := newFakeHost(t)
	code := f.write("OVMF/OVMF_CODE_4M.fd", "code-4m")
	vars := f.write("OVMF/OVMF_VARS_4M.fd", "vars-4m")
	f.write("OVMF/OVMF_CODE.fd", "code-2m")
	f.write("OVMF/OVMF_VARS.fd", "vars-2m")
	f.dpkg["--search "+code] = "ovmf: " + code + "\n"
	f.dpkg["--show ovmf"] = "2024.11-2"

	h := New(f.config()).Report(context.Background())

	if h.Kernel != "6.12.0-test" || h.MemoryBytes != 2048*1024 || h.Cpus <= 0 || h.Hostname == "" {
		t.Errorf("kernel/memory/cpus/hostname = %q/%d/%d/%q", h.Kernel, h.MemoryBytes, h.Cpus, h.Hostname)
	}
	if !h.Kvm.Accessible || h.Kvm.Error != "" || !h.VhostVsock.Accessible {
		t.Errorf("devices: kvm=%v vsock=%v", h.Kvm, h.VhostVsock)
	}
	if h.Accelerator != hypervisorv1.Accelerator_ACCELERATOR_KVM || h.ReadinessTransport != "vsock" {
		t.Errorf("accelerator %v, transport %q", h.Accelerator, h.ReadinessTransport)
	}
	if !h.Qemu.Found || h.Qemu.Path != "/fake/bin/qemu-system-x86_64" || h.Qemu.Version != "QEMU emulator version 9.2.0 (Debian 1:9.2+ds-1)" {
		t.Errorf("qemu = %v", h.Qemu)
	}
	if !h.Swtpm.Found || h.Swtpm.Version != "TPM emulator version 0.7.1, Copyright (c) 2014-2021 IBM Corp." {
		t.Errorf("swtpm = %v", h.Swtpm)
	}
	if !h.Systemd.Found || h.Systemd.Version != "systemd 257 (257.4-1)" {
		t.Errorf("systemd = %v", h.Systemd)
	}
	// The second pair is the first one present.
	if h.OvmfCode != code || h.OvmfVars != vars {
		t.Errorf("ovmf = %q, %q", h.OvmfCode, h.OvmfVars)
	}
	want := &hypervisorv1.Firmware{Sha256: sha("code-4m"), Package: "ovmf", Version: "2024.11-2"}
	if h.Firmware.Sha256 != want.Sha256 || h.Firmware.Package != want.Package || h.Firmware.Version != want.Version || h.Firmware.Error != "" {
		t.Errorf("firmware = %v, want %v", h.Firmware, want)
	}
	if !h.Ready || len(h.Missing) != 0 || len(h.Warnings) != 0 {
		t.Errorf("ready=%v missing=%q warnings=%q", h.Ready, h.Missing, h.Warnings)
	}
	if h.StorageProviders != nil {
		t.Errorf("storage providers = %q, want none (dir absent)", h.StorageProviders)
	}
}

func TestReportForceTCG(t *testing.T) {
	f := newFakeHost(t)
	f.write("OVMF/OVMF_CODE_4M.fd", "code-4m")
	f.write("OVMF/OVMF_VARS_4M.fd", "vars-4m")
	cfg := f.config()
	cfg.ForceTCG = true
	h := New(cfg).Report(context.Background())
	if !h.Kvm.Accessible || h.Accelerator != hypervisorv1.Accelerator_ACCELERATOR_TCG {
		t.Fatalf("kvm %v, accelerator %v; want TCG forced on a KVM host", h.Kvm, h.Accelerator)
	}
	if len(h.Warnings) != 1 || !strings.Contains(h.Warnings[0], "--accelerator=tcg") {
		t.Errorf("warnings %q", h.Warnings)
	}
}

func TestReportKVMUnusable(t *testing.T) {
	f := newFakeHost(t)
	f.write("OVMF/OVMF_CODE_4M.fd", "code-4m")
	f.write("OVMF/OVMF_VARS_4M.fd", "vars-4m")
	cfg := f.config()
	cfg.KVMUnusable = errors.New("the firmware wrote nothing within 4s")
	h := New(cfg).Report(context.Background())
	if !h.Kvm.Accessible || h.Accelerator != hypervisorv1.Accelerator_ACCELERATOR_TCG || !h.Ready {
		t.Fatalf("kvm %v, accelerator %v, ready %v", h.Kvm, h.Accelerator, h.Ready)
	}
	if len(h.Warnings) != 1 || !strings.Contains(h.Warnings[0], "wrote nothing") {
		t.Errorf("warnings %q", h.Warnings)
	}
}

func TestReportDegradedHost(t *testing.T) {
	f := newFakeHost(t)
	// Missing device and a directory (EISDIR) are both inaccessible.
	os.Remove(f.path("dev/kvm"))
	os.Remove(f.path("dev/vhost-vsock"))
	os.MkdirAll(f.path("dev/vhost-vsock"), 0o755)
	delete(f.tools, "qemu-system-x86_64")
	delete(f.tools, "swtpm")
	delete(f.tools, "systemctl")

	h := New(f.config()).Report(context.Background())

	if h.Kvm.Accessible || h.Kvm.Error != "no such file or directory" {
		t.Errorf("kvm = %v", h.Kvm)
	}
	if h.VhostVsock.Accessible || h.VhostVsock.Error != "is a directory" {
		t.Errorf("vhost-vsock = %v", h.VhostVsock)
	}
	if h.Accelerator != hypervisorv1.Accelerator_ACCELERATOR_TCG || h.ReadinessTransport != "virtio-serial" {
		t.Errorf("accelerator %v, transport %q", h.Accelerator, h.ReadinessTransport)
	}
	if h.Qemu.Found || h.Qemu.Error == "" || h.Swtpm.Found || h.Systemd.Found {
		t.Errorf("tools: qemu=%v swtpm=%v systemd=%v", h.Qemu, h.Swtpm, h.Systemd)
	}
	if h.Ready {
		t.Error("ready on a host without qemu")
	}
	wantMissing := []string{"qemu-system-x86_64", "swtpm", "OVMF code image not found"}
	if !slices.Equal(h.Missing, wantMissing) {
		t.Errorf("missing = %q, want %q", h.Missing, wantMissing)
	}
	wantWarnings := []string{
		f.path("dev/kvm") + " is not accessible (no such file or directory): VMs run under TCG, 10-50x slower",
		f.path("dev/vhost-vsock") + " is not accessible (is a directory): READY=1 travels over virtio-serial",
	}
	if !slices.Equal(h.Warnings, wantWarnings) {
		t.Errorf("warnings = %q, want %q", h.Warnings, wantWarnings)
	}
	if h.OvmfCode != "" || h.Firmware.GetError() == "" {
		t.Errorf("ovmf %q firmware %v", h.OvmfCode, h.Firmware)
	}
	// systemd is reported, never required.
	for _, m := range h.Missing {
		if strings.Contains(m, "systemd") {
			t.Errorf("systemd listed as missing: %q", h.Missing)
		}
	}
}

func TestReportOVMF(t *testing.T) {
	tests := []struct {
		name              string
		files             []string
		code, vars        string // Config overrides
		wantCode, wantVar string
		wantMissing       []string
		wantWarning       string
	}{
		{
			name:     "first pair wins",
			files:    []string{"edk2/x64/OVMF_CODE.4m.fd", "edk2/x64/OVMF_VARS.4m.fd", "OVMF/OVMF_CODE_4M.fd", "OVMF/OVMF_VARS_4M.fd"},
			wantCode: "edk2/x64/OVMF_CODE.4m.fd", wantVar: "edk2/x64/OVMF_VARS.4m.fd",
		},
		{
			name:     "a code image without its vars is skipped",
			files:    []string{"edk2/x64/OVMF_CODE.4m.fd", "OVMF/OVMF_CODE.fd", "OVMF/OVMF_VARS.fd"},
			wantCode: "OVMF/OVMF_CODE.fd", wantVar: "OVMF/OVMF_VARS.fd",
		},
		{
			name:        "none",
			wantMissing: []string{"OVMF code image not found"},
		},
		{
			name:     "configured, vars derived",
			files:    []string{"custom/MY_CODE.fd", "custom/MY_VARS.fd", "OVMF/OVMF_CODE.fd", "OVMF/OVMF_VARS.fd"},
			code:     "custom/MY_CODE.fd",
			wantCode: "custom/MY_CODE.fd", wantVar: "custom/MY_VARS.fd",
		},
		{
			name:     "configured, both",
			files:    []string{"custom/a.fd", "custom/b.fd"},
			code:     "custom/a.fd",
			vars:     "custom/b.fd",
			wantCode: "custom/a.fd", wantVar: "custom/b.fd",
		},
		{
			name:        "configured, vars missing",
			files:       []string{"custom/a.fd"},
			code:        "custom/a.fd",
			wantCode:    "custom/a.fd",
			wantWarning: "OVMF variable store template for {root}/custom/a.fd not found",
		},
		{
			name:        "configured but missing: the pairs are not probed",
			files:       []string{"OVMF/OVMF_CODE.fd", "OVMF/OVMF_VARS.fd"},
			code:        "custom/gone.fd",
			wantMissing: []string{"OVMF code image {root}/custom/gone.fd"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeHost(t)
			for _, p := range tt.files {
				f.write(p, p)
			}
			cfg := f.config()
			abs := func(rel string) string {
				if rel == "" {
					return ""
				}
				return f.path(rel)
			}
			cfg.OVMFCode, cfg.OVMFVars = abs(tt.code), abs(tt.vars)
			h := New(cfg).Report(context.Background())
			if h.OvmfCode != abs(tt.wantCode) || h.OvmfVars != abs(tt.wantVar) {
				t.Errorf("ovmf = %q, %q; want %q, %q", h.OvmfCode, h.OvmfVars, abs(tt.wantCode), abs(tt.wantVar))
			}
			var wantMissing []string
			for _, m := range tt.wantMissing {
				wantMissing = append(wantMissing, strings.ReplaceAll(m, "{root}", f.root))
			}
			if !slices.Equal(h.Missing, wantMissing) || h.Ready != (len(wantMissing) == 0) {
				t.Errorf("ready=%v missing = %q, want %q", h.Ready, h.Missing, wantMissing)
			}
			if tt.wantWarning != "" && !slices.Contains(h.Warnings, strings.ReplaceAll(tt.wantWarning, "{root}", f.root)) {
				t.Errorf("warnings = %q, want %q", h.Warnings, tt.wantWarning)
			}
			if tt.wantCode != "" && h.Firmware.Sha256 != sha(tt.wantCode) {
				t.Errorf("firmware sha256 = %q, want sha256(%q)", h.Firmware.Sha256, tt.wantCode)
			}
		})
	}
}

func TestFirmwarePackage(t *testing.T) {
	tests := []struct {
		name               string
		search, show       string // "" = command fails
		wantPkg, wantVer   string
		wantErrContains    string
		wantNoErrorMessage bool
	}{
		{name: "plain", search: "ovmf: {code}\n", show: "2025.02-8", wantPkg: "ovmf", wantVer: "2025.02-8", wantNoErrorMessage: true},
		{name: "diversion and shared", search: "diversion by x from: {code}\nedk2-ovmf, other: {code}\n", show: "1.0\n", wantPkg: "edk2-ovmf", wantVer: "1.0", wantNoErrorMessage: true},
		{name: "not from a package", search: "", wantErrContains: "dpkg-query --search"},
		{name: "show fails", search: "ovmf: {code}\n", show: "", wantPkg: "ovmf", wantErrContains: "dpkg-query --show"},
		{name: "garbage", search: "nothing useful\n", wantErrContains: "no package"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeHost(t)
			code := f.write("OVMF/OVMF_CODE.fd", "code")
			f.write("OVMF/OVMF_VARS.fd", "vars")
			if tt.search != "" {
				f.dpkg["--search "+code] = strings.ReplaceAll(tt.search, "{code}", code)
			}
			if tt.show != "" {
				f.dpkg["--show "+tt.wantPkg] = tt.show
			}
			fw := New(f.config()).Report(context.Background()).Firmware
			if fw.Sha256 != sha("code") {
				t.Errorf("sha256 = %q", fw.Sha256)
			}
			if fw.Package != tt.wantPkg || fw.Version != tt.wantVer {
				t.Errorf("package/version = %q/%q, want %q/%q", fw.Package, fw.Version, tt.wantPkg, tt.wantVer)
			}
			if tt.wantNoErrorMessage && fw.Error != "" {
				t.Errorf("error = %q", fw.Error)
			}
			if !strings.Contains(fw.Error, tt.wantErrContains) {
				t.Errorf("error = %q, want it to contain %q", fw.Error, tt.wantErrContains)
			}
		})
	}
}

func TestFirmwareHashCache(t *testing.T) {
	f := newFakeHost(t)
	code := f.write("OVMF/OVMF_CODE.fd", "one")
	f.write("OVMF/OVMF_VARS.fd", "vars")
	p := New(f.config())
	if got := p.Report(context.Background()).Firmware.Sha256; got != sha("one") {
		t.Fatalf("sha256 = %q", got)
	}

	// Same size and mtime: the cached digest is served, not re-read.
	st, _ := os.Stat(code)
	if err := os.WriteFile(code, []byte("two"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(code, st.ModTime(), st.ModTime()); err != nil {
		t.Fatal(err)
	}
	if got := p.Report(context.Background()).Firmware.Sha256; got != sha("one") {
		t.Errorf("after an unnoticeable change: sha256 = %q, want the cached one", got)
	}

	// A new mtime invalidates it.
	later := st.ModTime().Add(time.Minute)
	if err := os.Chtimes(code, later, later); err != nil {
		t.Fatal(err)
	}
	if got := p.Report(context.Background()).Firmware.Sha256; got != sha("two") {
		t.Errorf("after touch: sha256 = %q, want sha256(two)", got)
	}
}

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

func TestStorageProviders(t *testing.T) {
	f := newFakeHost(t)
	dir := f.path("run/io.systemd.StorageProvider")
	if err := os.MkdirAll(filepath.Join(dir, "subdir"), 0o755); err != nil {
		t.Fatal(err)
	}
	f.write("run/io.systemd.StorageProvider/not-a-socket", "")
	for _, name := range []string{"io.systemd.Volume", "io.systemd.Loop"} {
		l, err := net.Listen("unix", filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
	}
	h := New(f.config()).Report(context.Background())
	if want := []string{"io.systemd.Loop", "io.systemd.Volume"}; !slices.Equal(h.StorageProviders, want) {
		t.Errorf("storage providers = %q, want %q", h.StorageProviders, want)
	}
}

func TestMemTotalErrors(t *testing.T) {
	f := newFakeHost(t)
	f.write("proc/meminfo", "MemFree: 1 kB\n")
	os.Remove(f.path("proc/sys/kernel/osrelease"))
	h := New(f.config()).Report(context.Background())
	if h.MemoryBytes != 0 || h.Kernel != "" {
		t.Errorf("memory %d kernel %q", h.MemoryBytes, h.Kernel)
	}
	var memWarn, kernelWarn bool
	for _, w := range h.Warnings {
		memWarn = memWarn || strings.Contains(w, "no MemTotal")
		kernelWarn = kernelWarn || strings.HasPrefix(w, "kernel release:")
	}
	if !memWarn || !kernelWarn {
		t.Errorf("warnings = %q", h.Warnings)
	}
}

// TestReportRealHost runs against this machine with the defaults.
func TestReportRealHost(t *testing.T) {
	h := New(Config{}).Report(context.Background())
	t.Logf("host: %v", h)
	if h.Kernel == "" || h.Cpus <= 0 || h.MemoryBytes <= 0 {
		t.Errorf("kernel %q cpus %d memory %d", h.Kernel, h.Cpus, h.MemoryBytes)
	}
	// The accelerator follows an independent open test of /dev/kvm.
	wantAccel := hypervisorv1.Accelerator_ACCELERATOR_TCG
	if fd, err := os.OpenFile(DefaultKVMPath, os.O_RDWR, 0); err == nil {
		fd.Close()
		wantAccel = hypervisorv1.Accelerator_ACCELERATOR_KVM
	}
	if h.Accelerator != wantAccel {
		t.Errorf("accelerator = %v, want %v (kvm %v)", h.Accelerator, wantAccel, h.Kvm)
	}

	if _, err := os.Stat("/usr/bin/qemu-system-x86_64"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true but QEMU is not installed: %v", err)
		}
		t.Skipf("QEMU is not installed (%v); the tool and firmware checks need it", err)
	}
	if !h.Qemu.Found || !strings.Contains(h.Qemu.Version, "QEMU") {
		t.Errorf("qemu = %v", h.Qemu)
	}
	if !h.Swtpm.Found || !strings.Contains(h.Swtpm.Version, "TPM emulator") {
		t.Errorf("swtpm = %v", h.Swtpm)
	}
	if h.OvmfCode == "" || h.OvmfVars == "" {
		t.Errorf("ovmf = %q, %q", h.OvmfCode, h.OvmfVars)
	}
	if !regexp.MustCompile(`^[0-9a-f]{64}$`).MatchString(h.Firmware.GetSha256()) {
		t.Errorf("firmware sha256 = %q", h.Firmware.GetSha256())
	}
	if h.Firmware.GetPackage() != "ovmf" || h.Firmware.GetVersion() == "" {
		t.Errorf("firmware = %v", h.Firmware)
	}
	if !h.Ready || len(h.Missing) != 0 {
		t.Errorf("ready=%v missing=%q", h.Ready, h.Missing)
	}
}
