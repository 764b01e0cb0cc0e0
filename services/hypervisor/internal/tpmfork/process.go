package tpmfork

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// A fork's proxy runs as a process of its own (vmm-hypervisor tpm-proxy),
// in the VM's session like swtpm, so that it outlives the hypervisor:
// QEMU's tpm-emulator needs the control channel for as long as it runs (a
// suspend or a snapshot asks swtpm for its state over it), and it cannot
// reconnect to one. The process reports what Check says to a file the
// hypervisor reads before it continues the fork.

// Report is what a proxy process writes to its report file.
type Report struct {
	OK    bool   `json:"ok"`
	Error string `json:"error,omitempty"`
}

// Serve runs a proxy process: it listens on listen, relays to swtpmCtrl with
// the blobs of the files permanent and volatile, writes report whenever
// Check's answer changes, and returns once QEMU's connection ended, when no
// QEMU connected within idle, or when ctx ends.
func Serve(ctx context.Context, listen, swtpmCtrl, permanent, volatile, report string, idle time.Duration, logf func(string, ...any)) error {
	var b Blobs
	var err error
	if b.Permanent, err = os.ReadFile(permanent); err != nil {
		return err
	}
	if b.Volatile, err = os.ReadFile(volatile); err != nil {
		return err
	}
	p, err := Listen(listen, swtpmCtrl, b, logf)
	if err != nil {
		return err
	}
	defer p.Close()
	last := Report{Error: "-"}
	write := func() {
		r := Report{OK: true}
		if err := p.Check(); err != nil {
			r = Report{Error: err.Error()}
		}
		if r == last {
			return
		}
		last = r
		raw, _ := json.Marshal(r)
		tmp := filepath.Join(filepath.Dir(report), "."+filepath.Base(report)+".tmp")
		if err := os.WriteFile(tmp, raw, 0o600); err == nil {
			_ = os.Rename(tmp, report)
		}
	}
	idleTimer := time.NewTimer(idle)
	defer idleTimer.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-p.Handled():
			write()
			return nil
		case <-idleTimer.C:
			if len(p.Messages()) == 0 {
				return fmt.Errorf("no QEMU connected within %s", idle)
			}
		case <-tick.C:
			write()
		}
	}
}

// ReadReport waits (until ctx ends) for a proxy process's report to say
// the fork's vTPM state is its own.
func ReadReport(ctx context.Context, report string) error {
	for {
		var r Report
		raw, err := os.ReadFile(report)
		if err == nil && json.Unmarshal(raw, &r) == nil {
			if r.OK {
				return nil
			}
			if r.Error != "" && ctx.Err() != nil {
				return fmt.Errorf("tpmfork: %s", r.Error)
			}
		}
		select {
		case <-ctx.Done():
			if r.Error != "" {
				return fmt.Errorf("tpmfork: %s", r.Error)
			}
			return fmt.Errorf("tpmfork: the proxy reported nothing: %w", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}
