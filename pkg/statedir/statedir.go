// Package statedir guards a state directory against a second process.
package statedir

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// ErrInUse is returned when another live process holds the lock.
var ErrInUse = errors.New("state directory in use")

// Lock is an exclusive flock on <dir>/<name>.lock holding the owner's PID.
type Lock struct {
	f    *os.File
	path string
}

// Acquire creates dir (0700) if needed and takes the lock without waiting.
// The kernel drops a flock when its holder dies, so a crash never leaves a
// stale lock behind; the PID in the file only names the holder in the error.
func Acquire(dir, name string) (*Lock, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("state directory: %w", err)
	}
	path := filepath.Join(dir, name+".lock")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("state directory lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			holder := "another process"
			if b, rerr := os.ReadFile(path); rerr == nil {
				if pid, perr := strconv.Atoi(strings.TrimSpace(string(b))); perr == nil {
					holder = fmt.Sprintf("pid %d", pid)
				}
			}
			return nil, fmt.Errorf("%w: %s is locked by %s (%s)", ErrInUse, dir, holder, path)
		}
		return nil, fmt.Errorf("state directory lock %s: %w", path, err)
	}
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return &Lock{f: f, path: path}, nil
}

// Release drops the lock.
func (l *Lock) Release() error {
	if l == nil || l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}

// Default is $XDG_STATE_HOME/vm-manager, else ~/.local/state/vm-manager,
// else /var/lib/vm-manager.
func Default() string {
	if d := os.Getenv("XDG_STATE_HOME"); d != "" {
		return filepath.Join(d, "vm-manager")
	}
	if h, err := os.UserHomeDir(); err == nil && h != "" && h != "/" {
		return filepath.Join(h, ".local", "state", "vm-manager")
	}
	return "/var/lib/vm-manager"
}
