// Package proc runs the processes a VM is made of (QEMU, swtpm) so that they
// outlive the hypervisor, and adopts them again after its restart.
//
// A process is identified by its PID and its start time in clock ticks since
// boot (/proc/<pid>/stat field 22): a PID reused by an unrelated process after
// a host reboot or wrap-around has another start time and is never mistaken
// for ours.
package proc

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ErrGone means the process no longer runs (or its PID belongs to another one).
var ErrGone = errors.New("process is gone")

// Handle is what a VM record keeps to find its process again.
type Handle struct {
	PID        int
	StartTicks uint64
}

// Process is a running (or finished) process we started or adopted.
type Process struct {
	Handle
	done chan struct{}

	mu       sync.Mutex
	exitCode int  // valid once done, when known
	known    bool // exit code known (only for processes we started)
	waitErr  error
}

// Start starts cmd in a session of its own (setsid), so neither a signal to
// the hypervisor's process group nor its death reaches it.
func Start(cmd *exec.Cmd) (*Process, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setsid = true
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	ticks, err := StartTicks(cmd.Process.Pid)
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		return nil, fmt.Errorf("read start time of pid %d: %w", cmd.Process.Pid, err)
	}
	p := &Process{Handle: Handle{PID: cmd.Process.Pid, StartTicks: ticks}, done: make(chan struct{})}
	go func() {
		err := cmd.Wait()
		p.mu.Lock()
		if cmd.ProcessState != nil {
			p.exitCode, p.known = cmd.ProcessState.ExitCode(), true
		}
		p.waitErr = err
		p.mu.Unlock()
		close(p.done)
	}()
	return p, nil
}

// While returns a context that ends with ctx or when the process exits,
// whichever comes first: waiting for a process to answer stops as soon as
// it died.
func (p *Process) While(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		select {
		case <-p.Done():
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}

// Adopt takes over a process started by an earlier hypervisor. Its exit is
// observed through a pidfd; its exit code cannot be known (it is not our child).
func Adopt(h Handle) (*Process, error) {
	if h.PID <= 0 {
		return nil, fmt.Errorf("%w: no pid", ErrGone)
	}
	fd, err := unix.PidfdOpen(h.PID, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: pid %d: %v", ErrGone, h.PID, err)
	}
	// Check the start time after opening the pidfd: the fd pins the process,
	// so it cannot be replaced between the check and the watch.
	ticks, err := StartTicks(h.PID)
	if err != nil || ticks != h.StartTicks || zombie(h.PID) {
		unix.Close(fd)
		return nil, fmt.Errorf("%w: pid %d now belongs to another process", ErrGone, h.PID)
	}
	p := &Process{Handle: h, done: make(chan struct{})}
	go func() {
		defer unix.Close(fd)
		for {
			fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
			if _, err := unix.Poll(fds, -1); err != nil && !errors.Is(err, unix.EINTR) {
				break
			}
			if fds[0].Revents != 0 {
				break
			}
		}
		close(p.done)
	}()
	return p, nil
}

// Done is closed when the process has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Exited reports whether the process has exited.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// ExitCode returns the exit code once the process has exited; known is false
// for adopted processes and while it runs. -1 means killed by a signal.
func (p *Process) ExitCode() (code int, known bool) {
	if !p.Exited() {
		return 0, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.exitCode, p.known
}

// Signal sends sig unless the process has already exited.
func (p *Process) Signal(sig syscall.Signal) error {
	if p.Exited() {
		return ErrGone
	}
	if err := unix.Kill(p.PID, sig); err != nil {
		if errors.Is(err, unix.ESRCH) {
			return ErrGone
		}
		return err
	}
	return nil
}

// Terminate sends SIGTERM, waits up to grace, then SIGKILL, and waits for the exit.
func (p *Process) Terminate(grace time.Duration) {
	if p.Signal(syscall.SIGTERM) == nil {
		select {
		case <-p.done:
			return
		case <-time.After(grace):
		}
		_ = p.Signal(syscall.SIGKILL)
	}
	select {
	case <-p.done:
	case <-time.After(10 * time.Second): // a process stuck in D state; do not hang the caller forever
	}
}

// StartTicks reads a process's start time in clock ticks since boot.
func StartTicks(pid int) (uint64, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// comm (field 2) may contain spaces and parentheses: split after the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	fields := strings.Fields(s[i+1:])
	// fields[0] is field 3 (state); starttime is field 22.
	if len(fields) < 20 {
		return 0, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	return strconv.ParseUint(fields[19], 10, 64)
}

// zombie reports whether pid has exited but not been reaped.
func zombie(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && strings.HasPrefix(strings.TrimSpace(s[i+1:]), "Z")
}

// Stat is the CPU time and resident memory of a running process.
type Stat struct {
	CPUSeconds float64
	RSSBytes   int64
}

// ReadStat reads utime+stime and RSS from /proc.
func ReadStat(pid int) (Stat, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return Stat{}, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	fields := strings.Fields(s[i+1:])
	if i < 0 || len(fields) < 22 {
		return Stat{}, fmt.Errorf("malformed /proc/%d/stat", pid)
	}
	utime, _ := strconv.ParseUint(fields[11], 10, 64) // field 14
	stime, _ := strconv.ParseUint(fields[12], 10, 64) // field 15
	rss, _ := strconv.ParseInt(fields[21], 10, 64)    // field 24, pages
	const ticksPerSecond = 100                        // USER_HZ on Linux
	return Stat{
		CPUSeconds: float64(utime+stime) / ticksPerSecond,
		RSSBytes:   rss * int64(os.Getpagesize()),
	}, nil
}

// Running is a process found by Scan: its handle and its argv.
type Running struct {
	Handle
	Argv []string
}

// Scan lists the running processes (zombies left out) whose argv match
// accepts. Processes that exit while it reads are skipped.
func Scan(match func(argv []string) bool) ([]Running, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	var out []Running
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		raw, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil || len(raw) == 0 {
			continue // gone, or a kernel thread
		}
		argv := strings.Split(strings.TrimSuffix(string(raw), "\x00"), "\x00")
		if !match(argv) || zombie(pid) {
			continue
		}
		ticks, err := StartTicks(pid)
		if err != nil {
			continue
		}
		out = append(out, Running{Handle: Handle{PID: pid, StartTicks: ticks}, Argv: argv})
	}
	return out, nil
}
