package vm

import (
	"context"
	"errors"
	"io/fs"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/consolelog"
)

// Consoles are the VMs' serial consoles: reads of their last lines, and the
// loop that keeps each under its cap.
type Consoles struct {
	cfg   Config
	log   *slog.Logger
	table *Table

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	once   sync.Once
}

// NewConsoles reads the Table's VMs' consoles; Run starts the rotation.
func NewConsoles(cfg Config, log *slog.Logger, table *Table) *Consoles {
	cfg.defaults()
	ctx, cancel := context.WithCancel(context.Background())
	return &Consoles{cfg: cfg, log: log, table: table, ctx: ctx, cancel: cancel}
}

// Run starts the rotation loop (once).
func (cs *Consoles) Run() { cs.once.Do(func() { cs.wg.Go(cs.consoleLoop) }) }

// Close ends the rotation loop.
func (cs *Consoles) Close() {
	cs.cancel()
	cs.wg.Wait()
}

// The serial console's bound (--console-log-max-bytes): console.log and
// console.log.1 together, plus what a guest writes within one check.
const (
	DefaultConsoleLogMaxBytes = 8 << 20
	MinConsoleLogMaxBytes     = 64 << 10
	// consoleCheckInterval is how often the consoles' sizes are looked at: a
	// stat per VM. A TCG guest writing its serial port flat out adds about
	// 1 MB/s.
	consoleCheckInterval = 250 * time.Millisecond
)

// consoleCounters are one VM's console rotations since the hypervisor started.
type consoleCounters struct {
	rotations, moved, dropped atomic.Uint64
	// unsafe is set once a QEMU was found writing without O_APPEND (started
	// by a vm-manager before append=on), so that it is logged once.
	unsafe atomic.Bool
}

// ConsoleCounters are one VM's console rotations: how many, the bytes moved
// out of console.log and the bytes no longer kept.
type ConsoleCounters struct {
	Rotations, RotatedBytes, DroppedBytes uint64
}

// consoleLoop keeps every VM's console under the cap, from the start (a
// hypervisor that was down finds the files as large as the guests made
// them meanwhile) until the hypervisor stops.
func (cs *Consoles) consoleLoop() {
	interval := cs.cfg.ConsoleCheckInterval
	if interval <= 0 {
		interval = consoleCheckInterval
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		cs.rotateConsoles()
		select {
		case <-cs.ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (cs *Consoles) rotateConsoles() {
	cs.table.mu.Lock()
	mcs := make([]*machine, 0, len(cs.table.machines))
	for _, mc := range cs.table.machines {
		mcs = append(mcs, mc)
	}
	cs.table.mu.Unlock()
	limit := cs.cfg.ConsoleLogMaxBytes
	for _, mc := range mcs {
		mc.mu.Lock()
		path, pid := mc.rec.GetPaths().GetConsole(), int(mc.rec.GetProcesses().GetQemu().GetPid())
		mc.mu.Unlock()
		if path == "" {
			continue
		}
		if fi, err := os.Stat(path); err != nil || fi.Size() < limit/2 {
			continue
		}
		if pid > 0 {
			switch ok, err := consolelog.AppendOnly(pid, path); {
			case errors.Is(err, fs.ErrNotExist):
				// QEMU is gone meanwhile: nothing writes the file.
			case err != nil:
				cs.log.Warn("console not rotated: cannot tell how qemu writes it", "vm", mc.id, "pid", pid, "error", err)
				continue
			case !ok:
				if !mc.console.unsafe.Swap(true) {
					cs.log.Warn("console not rotated: its qemu was started without append=on (by an older vm-manager); it is bounded from the VM's next start", "vm", mc.id, "pid", pid)
				}
				continue
			}
		}
		r, err := consolelog.Rotate(path, limit)
		if err != nil {
			cs.log.Warn("console rotation", "vm", mc.id, "error", err)
			continue
		}
		if r.Rotated {
			mc.console.rotations.Add(1)
			mc.console.moved.Add(uint64(r.Moved))
			mc.console.dropped.Add(uint64(r.Dropped))
			cs.log.Debug("console rotated", "vm", mc.id, "moved", r.Moved, "kept", r.Kept, "dropped", r.Dropped)
		}
	}
}

// ConsoleCounters are every VM's console rotations, by VM id.
func (cs *Consoles) ConsoleCounters() map[string]ConsoleCounters {
	cs.table.mu.Lock()
	defer cs.table.mu.Unlock()
	out := make(map[string]ConsoleCounters, len(cs.table.machines))
	for id, mc := range cs.table.machines {
		out[id] = ConsoleCounters{Rotations: mc.console.rotations.Load(), RotatedBytes: mc.console.moved.Load(), DroppedBytes: mc.console.dropped.Load()}
	}
	return out
}
