// Package initsys holds what a minimal PID 1 needs: mounts, kernel modules, zombie
// reaping, the ACPI power button and power-off.
package initsys

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// Mount is one filesystem to mount at boot.
type Mount struct {
	Source, Target, FSType string
	Flags                  uintptr
	Data                   string
	Optional               bool // failure is reported but not fatal
}

// Mounts is the boot-time mount table, in order.
var Mounts = []Mount{
	{"proc", "/proc", "proc", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, "", false},
	{"sysfs", "/sys", "sysfs", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, "", false},
	{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID, "mode=0755", false},
	{"devpts", "/dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "mode=0620,ptmxmode=0666", true},
	{"tmpfs", "/run", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=0755", false},
	{"tmpfs", "/tmp", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=1777", false},
	// The TPM event log lives here (binary_bios_measurements).
	{"securityfs", "/sys/kernel/security", "securityfs", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, "", true},
}

// MountAll mounts ms in order. Already-mounted targets (EBUSY) count as success.
// Errors of optional mounts are returned in warnings; the first required failure
// stops and is returned as err.
func MountAll(ms []Mount) (warnings []error, err error) {
	for _, m := range ms {
		if e := os.MkdirAll(m.Target, 0o755); e != nil {
			err = fmt.Errorf("mkdir %s: %w", m.Target, e)
		} else if e := unix.Mount(m.Source, m.Target, m.FSType, m.Flags, m.Data); e != nil && !errors.Is(e, unix.EBUSY) {
			err = fmt.Errorf("mount %s on %s: %w", m.FSType, m.Target, e)
		}
		if err != nil {
			if !m.Optional {
				return warnings, err
			}
			warnings = append(warnings, err)
			err = nil
		}
	}
	// Shells and tools expect these; devtmpfs does not provide them.
	for name, target := range map[string]string{"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2"} {
		_ = os.Symlink(target, filepath.Join("/dev", name))
	}
	return warnings, nil
}

// ModuleOrderFile lists, one file name per line, the modules under the same directory
// in dependency order; mkinitramfs writes it.
const ModuleOrderFile = "modules.load"

// LoadModules loads the modules listed in dir/modules.load in order with
// finit_module. Modules already present (EEXIST) count as loaded. It returns the names
// it loaded or found loaded and the first error; a failed module stops the rest,
// because later ones may depend on it.
func LoadModules(dir string) ([]string, error) {
	names, err := ReadModuleOrder(filepath.Join(dir, ModuleOrderFile))
	if err != nil {
		return nil, err
	}
	var loaded []string
	for _, n := range names {
		if err := LoadModule(filepath.Join(dir, n)); err != nil {
			return loaded, err
		}
		loaded = append(loaded, strings.TrimSuffix(n, ".ko"))
	}
	return loaded, nil
}

// ReadModuleOrder reads a modules.load file: one name per line, blank lines and
// # comments. mkinitramfs reads its -module-order file with it too.
func ReadModuleOrder(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var names []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line, _, _ := strings.Cut(sc.Text(), "#")
		if line = strings.TrimSpace(line); line == "" {
			continue
		}
		if strings.Contains(line, "/") {
			return nil, fmt.Errorf("%s: %q: module names only", path, line)
		}
		names = append(names, line)
	}
	return names, sc.Err()
}

// LoadModule loads one .ko file; EEXIST (already loaded) is success.
func LoadModule(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.FinitModule(int(f.Fd()), "", 0); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("finit_module %s: %w", filepath.Base(path), err)
	}
	return nil
}

// SetHostname sets the kernel hostname and writes /etc/hostname for tools that read it.
func SetHostname(name string) error {
	if err := ValidHostname(name); err != nil {
		return err
	}
	if err := unix.Sethostname([]byte(name)); err != nil {
		return fmt.Errorf("sethostname: %w", err)
	}
	return os.WriteFile("/etc/hostname", []byte(name+"\n"), 0o644)
}

// ValidHostname accepts what the kernel and RFC 1123 allow: up to 64 bytes of letters,
// digits, '-' and '.', without empty labels.
func ValidHostname(name string) error {
	if name == "" || len(name) > 64 {
		return fmt.Errorf("hostname %q: length must be 1..64", name)
	}
	for _, label := range strings.Split(name, ".") {
		if label == "" || label[0] == '-' || label[len(label)-1] == '-' {
			return fmt.Errorf("hostname %q: bad label", name)
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
				return fmt.Errorf("hostname %q: bad character %q", name, c)
			}
		}
	}
	return nil
}

// NormalizeMachineID accepts 32 hex digits (any case) or a UUID with dashes and
// returns 32 lower-case hex digits. All-zero IDs are rejected: they mean "unset".
func NormalizeMachineID(s string) (string, error) {
	id := strings.ToLower(strings.ReplaceAll(strings.TrimSpace(s), "-", ""))
	if len(id) != 32 {
		return "", fmt.Errorf("machine id %q: want 32 hex digits", s)
	}
	for _, c := range id {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return "", fmt.Errorf("machine id %q: not hex", s)
		}
	}
	if strings.Trim(id, "0") == "" {
		return "", fmt.Errorf("machine id %q: all zero", s)
	}
	return id, nil
}

// WriteMachineID writes /etc/machine-id in the systemd format.
func WriteMachineID(path, id string) error {
	return os.WriteFile(path, []byte(id+"\n"), 0o444)
}
