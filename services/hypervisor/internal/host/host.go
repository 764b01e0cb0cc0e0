// Package host measures what this machine can run: devices, tools, firmware.
package host

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
)

// CommandTimeout bounds every command the prober runs.
const CommandTimeout = 5 * time.Second

// Defaults of Config.
const (
	DefaultKVMPath            = "/dev/kvm"
	DefaultVhostVsockPath     = "/dev/vhost-vsock"
	DefaultQEMUBinary         = "qemu-system-x86_64"
	DefaultSwtpmBinary        = "swtpm"
	DefaultProcRoot           = "/proc"
	DefaultStorageProviderDir = "/run/systemd/io.systemd.StorageProvider"
)

// OVMFPair is an OVMF code image and the variable store template shipped with it.
type OVMFPair struct {
	Code string
	Vars string
}

// DefaultOVMFPairs are probed in this order when Config.OVMFCode is empty:
// the contract's order. Debian 12's 2 MiB build (OVMF_CODE.fd) reaches the
// kernel ~4 s sooner under TCG and measures the boot the same way, but it is
// not the default: an image's golden values name the firmware build they were
// recorded on (golden_firmware), so changing the default would make every
// image measured before the upgrade fail attestation, and Debian 13 ships
// only the 4 MiB build. Operators opt in with --ovmf-code/--ovmf-vars
// (docs/performance.md#create-to-ready).
var DefaultOVMFPairs = []OVMFPair{
	{"/usr/share/edk2/x64/OVMF_CODE.4m.fd", "/usr/share/edk2/x64/OVMF_VARS.4m.fd"},
	{"/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd"},
	{"/usr/share/OVMF/OVMF_CODE.fd", "/usr/share/OVMF/OVMF_VARS.fd"},
	{"/usr/share/edk2/ovmf/OVMF_CODE.fd", "/usr/share/edk2/ovmf/OVMF_VARS.fd"},
}

// Config says where to look. Zero values take the defaults above.
type Config struct {
	KVMPath        string
	VhostVsockPath string
	QEMUBinary     string
	QEMUImgBinary  string // used by the driver only (forks' disk overlays)
	SwtpmBinary    string
	// OVMFCode and OVMFVars override the probe of OVMFPairs.
	OVMFCode string
	OVMFVars string
	// OVMFPairs defaults to DefaultOVMFPairs.
	OVMFPairs          []OVMFPair
	ProcRoot           string
	StorageProviderDir string
	// Run runs a command and returns its stdout; defaults to os/exec.
	Run func(ctx context.Context, name string, args ...string) ([]byte, error)
	// LookPath resolves a program on PATH; defaults to exec.LookPath.
	LookPath func(file string) (string, error)
	// KVMUnusable, when set, is why KVM cannot run guests although /dev/kvm
	// opens (qemu.ProbeKVM): VMs then run under TCG.
	KVMUnusable error
	// ForceTCG makes VMs use TCG even where /dev/kvm works (--accelerator=tcg),
	// e.g. to reproduce CI's timing on a KVM host.
	ForceTCG bool
	// Node is this host's place in a fleet, reported as is (docs/fleet.md).
	Node Node
	// VTPMCACertificate is the PEM of the CA that signs the vTPMs' EK
	// certificates, reported as is.
	VTPMCACertificate string
}

// Prober builds Host reports. It is safe for concurrent use.
type Prober struct {
	cfg Config

	mu      sync.Mutex
	hashes  map[string]hashEntry
	outputs map[string]outputEntry
}

// hashEntry caches a firmware digest: the image is a few MB and rarely changes.
type hashEntry struct {
	modTime time.Time
	size    int64
	sum     string
}

// outputEntry caches a command's output about one file (a program's
// --version, the package shipping the firmware) while the file keeps its
// size and mtime: get_host is a hot call, and five forks per report under a
// few hundred concurrent callers starved the host (and ran into
// CommandTimeout, reporting tools as broken).
type outputEntry struct {
	modTime time.Time
	size    int64
	out     []byte
}

// New returns a Prober with the defaults filled in.
func New(cfg Config) *Prober {
	def := func(s *string, v string) {
		if *s == "" {
			*s = v
		}
	}
	def(&cfg.KVMPath, DefaultKVMPath)
	def(&cfg.VhostVsockPath, DefaultVhostVsockPath)
	def(&cfg.QEMUBinary, DefaultQEMUBinary)
	def(&cfg.SwtpmBinary, DefaultSwtpmBinary)
	def(&cfg.ProcRoot, DefaultProcRoot)
	def(&cfg.StorageProviderDir, DefaultStorageProviderDir)
	if cfg.OVMFPairs == nil {
		cfg.OVMFPairs = DefaultOVMFPairs
	}
	if cfg.Run == nil {
		cfg.Run = execRun
	}
	if cfg.LookPath == nil {
		cfg.LookPath = exec.LookPath
	}
	return &Prober{cfg: cfg, hashes: map[string]hashEntry{}, outputs: map[string]outputEntry{}}
}

// Node is a fleet node's identity: the fleet gateway routes by Index (the
// prefix of the node's VM ids) and places VMs by Labels.
type Node struct {
	Name string
	// Index is nil outside a fleet.
	Index  *int32
	Labels map[string]string
}

// Report measures the host now. It never fails: what cannot be measured is
// reported in the fields' error texts, missing and warnings.
func (p *Prober) Report(ctx context.Context) *hypervisorv1.Host {
	h := &hypervisorv1.Host{Cpus: int32(runtime.NumCPU())}
	var warnings []string

	if name, err := os.Hostname(); err == nil {
		h.Hostname = name
	} else {
		warnings = append(warnings, "hostname: "+err.Error())
	}
	if b, err := os.ReadFile(filepath.Join(p.cfg.ProcRoot, "sys/kernel/osrelease")); err == nil {
		h.Kernel = strings.TrimSpace(string(b))
	} else {
		warnings = append(warnings, "kernel release: "+err.Error())
	}
	if mem, err := memTotal(filepath.Join(p.cfg.ProcRoot, "meminfo")); err == nil {
		h.MemoryBytes = mem
	} else {
		warnings = append(warnings, "memory: "+err.Error())
	}

	h.Kvm = openTest(p.cfg.KVMPath)
	h.VhostVsock = openTest(p.cfg.VhostVsockPath)

	code, vars, ovmfWarn := p.ovmf()
	h.OvmfCode, h.OvmfVars = code, vars

	// The commands are independent; running them side by side keeps the
	// report within a couple of CommandTimeouts even when tools hang.
	var wg sync.WaitGroup
	wg.Go(func() { h.Qemu = p.tool(ctx, p.cfg.QEMUBinary, "--version") })
	wg.Go(func() { h.Swtpm = p.tool(ctx, p.cfg.SwtpmBinary, "--version") })
	wg.Go(func() { h.Systemd = p.tool(ctx, "systemctl", "--version") })
	if code != "" {
		wg.Go(func() { h.Firmware = p.firmware(ctx, code) })
	} else {
		h.Firmware = &hypervisorv1.Firmware{Error: "no OVMF code image found"}
	}
	h.StorageProviders = storageProviders(p.cfg.StorageProviderDir)
	wg.Wait()

	switch {
	case h.Kvm.Accessible && p.cfg.KVMUnusable != nil:
		h.Accelerator = hypervisorv1.Accelerator_ACCELERATOR_TCG
		warnings = append(warnings, fmt.Sprintf("%s opens but KVM cannot run a guest here (%v): VMs run under TCG", h.Kvm.Path, p.cfg.KVMUnusable))
	case h.Kvm.Accessible && p.cfg.ForceTCG:
		h.Accelerator = hypervisorv1.Accelerator_ACCELERATOR_TCG
		warnings = append(warnings, "--accelerator=tcg: VMs run under TCG although "+h.Kvm.Path+" is usable")
	case h.Kvm.Accessible:
		h.Accelerator = hypervisorv1.Accelerator_ACCELERATOR_KVM
	default:
		h.Accelerator = hypervisorv1.Accelerator_ACCELERATOR_TCG
		warnings = append(warnings, fmt.Sprintf("%s is not accessible (%s): VMs run under TCG, 10-50x slower", h.Kvm.Path, h.Kvm.Error))
	}
	if h.VhostVsock.Accessible {
		h.ReadinessTransport = "vsock"
	} else {
		h.ReadinessTransport = "virtio-serial"
		warnings = append(warnings, fmt.Sprintf("%s is not accessible (%s): READY=1 travels over virtio-serial", h.VhostVsock.Path, h.VhostVsock.Error))
	}
	warnings = append(warnings, ovmfWarn...)

	if !h.Qemu.Found {
		h.Missing = append(h.Missing, "qemu-system-x86_64")
	}
	if !h.Swtpm.Found {
		h.Missing = append(h.Missing, "swtpm")
	}
	if code == "" {
		want := "not found"
		if p.cfg.OVMFCode != "" {
			want = p.cfg.OVMFCode
		}
		h.Missing = append(h.Missing, "OVMF code image "+want)
	}
	h.Ready = len(h.Missing) == 0
	h.NodeName, h.NodeIndex, h.NodeLabels = p.cfg.Node.Name, p.cfg.Node.Index, p.cfg.Node.Labels
	h.Warnings = warnings
	h.VtpmCaCertificate = p.cfg.VTPMCACertificate
	return h
}

// openTest opens path O_RDWR the way QEMU will, and closes it right away.
func openTest(path string) *hypervisorv1.Device {
	d := &hypervisorv1.Device{Path: path}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		d.Error = shortErr(err)
		return d
	}
	_ = f.Close()
	d.Accessible = true
	return d
}

// shortErr drops the "open <path>:" prefix; the path is reported next to it.
func shortErr(err error) string {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err.Error()
	}
	return err.Error()
}

func memTotal(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		rest, ok := strings.CutPrefix(sc.Text(), "MemTotal:")
		if !ok {
			continue
		}
		fields := strings.Fields(rest)
		if len(fields) == 0 {
			break
		}
		kb, err := strconv.ParseInt(fields[0], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%s: MemTotal %q: %w", path, fields[0], err)
		}
		return kb * 1024, nil
	}
	if err := sc.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("%s: no MemTotal line", path)
}

func (p *Prober) tool(ctx context.Context, name string, args ...string) *hypervisorv1.Tool {
	t := &hypervisorv1.Tool{}
	path, err := p.cfg.LookPath(name)
	if err != nil {
		t.Error = err.Error()
		return t
	}
	t.Found, t.Path = true, path
	out, err := p.runAbout(ctx, path, path, args...)
	if err != nil {
		t.Error = err.Error()
		return t
	}
	t.Version = firstLine(out)
	return t
}

// runAbout is run for a command whose output depends only on file: a
// successful output is served again while file keeps its size and mtime.
func (p *Prober) runAbout(ctx context.Context, file, name string, args ...string) ([]byte, error) {
	key := strings.Join(append([]string{file, name}, args...), "\x00")
	fi, statErr := os.Stat(file)
	if statErr == nil {
		p.mu.Lock()
		e, ok := p.outputs[key]
		p.mu.Unlock()
		if ok && e.size == fi.Size() && e.modTime.Equal(fi.ModTime()) {
			return e.out, nil
		}
	}
	out, err := p.run(ctx, name, args...)
	if err == nil && statErr == nil {
		p.mu.Lock()
		p.outputs[key] = outputEntry{modTime: fi.ModTime(), size: fi.Size(), out: out}
		p.mu.Unlock()
	}
	return out, err
}

func (p *Prober) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, CommandTimeout)
	defer cancel()
	out, err := p.cfg.Run(ctx, name, args...)
	if err == nil && ctx.Err() != nil {
		err = ctx.Err()
	}
	if err != nil {
		return out, fmt.Errorf("%s %s: %w", filepath.Base(name), strings.Join(args, " "), err)
	}
	return out, nil
}

func firstLine(b []byte) string {
	line, _, _ := bytes.Cut(b, []byte("\n"))
	return strings.TrimSpace(string(line))
}

// ovmf returns the code and vars images to use, and warnings about them.
func (p *Prober) ovmf() (code, vars string, warnings []string) {
	if p.cfg.OVMFCode != "" {
		if !isFile(p.cfg.OVMFCode) {
			return "", "", nil
		}
		vars = p.cfg.OVMFVars
		if vars == "" {
			vars = siblingVars(p.cfg.OVMFCode)
		}
		if vars == "" || !isFile(vars) {
			warnings = append(warnings, fmt.Sprintf("OVMF variable store template for %s not found", p.cfg.OVMFCode))
			vars = ""
		}
		return p.cfg.OVMFCode, vars, warnings
	}
	for _, pair := range p.cfg.OVMFPairs {
		if isFile(pair.Code) && isFile(pair.Vars) {
			return pair.Code, pair.Vars, nil
		}
	}
	return "", "", nil
}

// siblingVars guesses the VARS file shipped next to a CODE file.
func siblingVars(code string) string {
	dir, base := filepath.Split(code)
	i := strings.LastIndex(base, "CODE")
	if i < 0 {
		return ""
	}
	return filepath.Join(dir, base[:i]+"VARS"+base[i+len("CODE"):])
}

func isFile(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular()
}

func (p *Prober) firmware(ctx context.Context, code string) *hypervisorv1.Firmware {
	fw := &hypervisorv1.Firmware{}
	var errs []string
	if sum, err := p.hash(code); err == nil {
		fw.Sha256 = sum
	} else {
		errs = append(errs, err.Error())
	}
	pkg, ver, err := p.dpkg(ctx, code)
	fw.Package, fw.Version = pkg, ver
	if err != nil {
		errs = append(errs, err.Error())
	}
	fw.Error = strings.Join(errs, "; ")
	return fw
}

func (p *Prober) hash(path string) (string, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return "", err
	}
	p.mu.Lock()
	e, ok := p.hashes[path]
	p.mu.Unlock()
	if ok && e.size == fi.Size() && e.modTime.Equal(fi.ModTime()) {
		return e.sum, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", fmt.Errorf("hashing %s: %w", path, err)
	}
	sum := hex.EncodeToString(h.Sum(nil))
	p.mu.Lock()
	p.hashes[path] = hashEntry{modTime: fi.ModTime(), size: fi.Size(), sum: sum}
	p.mu.Unlock()
	return sum, nil
}

// dpkg names the Debian package shipping path and its installed version.
func (p *Prober) dpkg(ctx context.Context, path string) (pkg, version string, err error) {
	out, err := p.runAbout(ctx, path, "dpkg-query", "--search", path)
	if err != nil {
		return "", "", err
	}
	// Lines look like "ovmf: /usr/share/OVMF/OVMF_CODE_4M.fd" or, when shared,
	// "a, b: <path>"; "diversion by ..." lines are skipped.
	var query string
	for line := range strings.Lines(string(out)) {
		if strings.HasPrefix(line, "diversion ") {
			continue
		}
		names, _, ok := strings.Cut(line, ": ")
		if !ok {
			continue
		}
		first, _, _ := strings.Cut(names, ",")
		query = strings.TrimSpace(first)
		break
	}
	if query == "" {
		return "", "", fmt.Errorf("dpkg-query --search %s: no package in output %q", path, firstLine(out))
	}
	// A multiarch name ("libfoo:amd64") is queried as such, reported without the arch.
	pkg, _, _ = strings.Cut(query, ":")
	out, err = p.runAbout(ctx, path, "dpkg-query", "--show", "--showformat=${Version}", query)
	if err != nil {
		return pkg, "", err
	}
	version = strings.TrimSpace(string(out))
	if version == "" {
		return pkg, "", fmt.Errorf("dpkg-query --show %s: no version", query)
	}
	return pkg, version, nil
}

func storageProviders(dir string) []string {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	var names []string
	for _, e := range entries {
		if e.Type()&fs.ModeSocket != 0 {
			names = append(names, e.Name())
		}
	}
	return names
}

// execRun runs a command and returns its stdout; the error carries the first
// line of stderr, which is usually the reason.
func execRun(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	// A child that keeps the pipes open must not outlive the timeout.
	cmd.WaitDelay = time.Second
	out, err := cmd.Output()
	if err != nil {
		if msg := firstLine(stderr.Bytes()); msg != "" {
			return out, fmt.Errorf("%w: %s", err, msg)
		}
		return out, err
	}
	return out, nil
}
