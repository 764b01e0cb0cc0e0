package initsys

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

// children started with StartCmd: their exit status belongs to their cmd.Wait.
var children = struct {
	mu      sync.Mutex // held while starting one and while reaping
	managed map[int]struct{}
}{managed: map[int]struct{}{}}

// ReapZombies waits for every child that exits, as PID 1 must for orphans re-parented
// to it, until ctx ends. Children run with os/exec must be started with StartCmd,
// or this loop steals their exit statuses from cmd.Wait.
func ReapZombies(ctx context.Context) {
	ch := make(chan os.Signal, 16)
	signal.Notify(ch, unix.SIGCHLD)
	defer signal.Stop(ch)
	for {
		reapAll()
		select {
		case <-ctx.Done():
			return
		case <-ch:
		}
	}
}

// StartCmd starts cmd so that ReapZombies leaves it to cmd.Wait; call done once
// Wait returned.
func StartCmd(cmd *exec.Cmd) (done func(), err error) {
	// Under the lock: a child that exits at once is registered before the
	// reaper can look at it.
	children.mu.Lock()
	defer children.mu.Unlock()
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	pid := cmd.Process.Pid
	children.managed[pid] = struct{}{}
	return func() {
		children.mu.Lock()
		delete(children.managed, pid)
		children.mu.Unlock()
		reapAll() // orphans that exited meanwhile may have had their SIGCHLD already
	}, nil
}

func reapAll() {
	children.mu.Lock()
	defer children.mu.Unlock()
	if len(children.managed) == 0 {
		reap(-1)
		return
	}
	// wait4(-1) could pick a managed child: reap the others one by one.
	for _, pid := range childPIDs() {
		if _, ok := children.managed[pid]; !ok {
			reap(pid)
		}
	}
}

// reap waits for pid (-1: any child) without blocking, as long as there are zombies.
func reap(pid int) {
	for {
		var ws unix.WaitStatus
		got, err := unix.Wait4(pid, &ws, unix.WNOHANG, nil)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if got <= 0 || err != nil || pid > 0 {
			return
		}
	}
}

// childPIDs lists this process's children from /proc (/proc/<pid>/task/*/children
// needs CONFIG_PROC_CHILDREN).
func childPIDs() []int {
	self := os.Getpid()
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var pids []int
	for _, p := range stats {
		b, err := os.ReadFile(p)
		if err != nil {
			continue // gone meanwhile
		}
		// "pid (comm) state ppid ...": comm may hold spaces and parentheses.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := bytes.Fields(b[i+1:])
		if len(f) < 2 {
			continue
		}
		if ppid, err := strconv.Atoi(string(f[1])); err != nil || ppid != self {
			continue
		}
		if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p))); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}
