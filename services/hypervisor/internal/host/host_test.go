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

// TestReportTCGDespiteKVM: /dev/kvm opens, yet VMs run under TCG, with one
// warning saying why: the operator asked for it, or KVM was found unusable.
func TestReportTCGDespiteKVM(t *testing.T) {
	tests := []struct {
		name    string
		set     func(*Config)
		warning string
	}{
		{"forced", func(c *Config) { c.ForceTCG = true }, "--accelerator=tcg"},
		{"kvm unusable", func(c *Config) { c.KVMUnusable = errors.New("the firmware wrote nothing within 4s") }, "wrote nothing"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeHost(t)
			f.write("OVMF/OVMF_CODE_4M.fd", "code-4m")
			f.write("OVMF/OVMF_VARS_4M.fd", "vars-4m")
			cfg := f.config()
			tt.set(&cfg)
			h := New(cfg).Report(context.Background())
			if !h.Kvm.Accessible || h.Accelerator != hypervisorv1.Accelerator_ACCELERATOR_TCG || !h.Ready {
				t.Fatalf("kvm %v, accelerator %v, ready %v; want TCG on a KVM host", h.Kvm, h.Accelerator, h.Ready)
			}
			if len(h.Warnings) != 1 || !strings.Contains(h.Warnings[0], tt.warning) {
				t.Errorf("warnings %q", h.Warnings)
			}
		})
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
