package vm

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
)

// sweepMarker, in a VM's directory, is there while the directory may have no
// record: from a create's mkdir until its record is written, and from a
// delete's start until the directory is gone. A directory without a record is
// removed at start only with it, so a database restored from an older copy
// never costs the disks of VMs it does not know.
const sweepMarker = "unrecorded"

// makeDir creates a new VM's directory, marked until its record is written.
func (tb *Table) makeDir(id string) error {
	if err := os.MkdirAll(tb.vmDir(id), 0o700); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(tb.vmDir(id), sweepMarker), nil, 0o600)
}

// markDeleted marks a VM's directory before its record is deleted; a VM
// without a directory (a create that failed early) needs no mark.
func (tb *Table) markDeleted(id string) error {
	err := os.WriteFile(filepath.Join(tb.vmDir(id), sweepMarker), nil, 0o600)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}

// unmark removes the mark once a record owns the directory again (a create's
// record written, a delete that failed).
func (tb *Table) unmark(id string) {
	if err := os.Remove(filepath.Join(tb.vmDir(id), sweepMarker)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		tb.log.Error("unmark vm directory", "vm", id, "error", err)
	}
}

// removeDir removes a deleted VM's files; what it cannot remove the next
// start's sweepDeleted tries again.
func (tb *Table) removeDir(id string) {
	if err := os.RemoveAll(tb.vmDir(id)); err != nil {
		tb.log.Error("remove files of a deleted vm; retried at the next start", "vm", id, "error", err)
	}
}

// sweepDeleted finishes creates and deletes a restart cut short, after the
// records are loaded and stray processes ended: leases and marked directories
// of VMs without a record (a create before its record was written, a delete
// after) are released and removed. An unmarked directory
// without a record is reported and left alone.
func (m *Manager) sweepDeleted() {
	m.table.mu.Lock()
	known := make(map[string]bool, len(m.table.machines))
	for id := range m.table.machines {
		known[id] = true
	}
	m.table.mu.Unlock()
	m.nets.ReleaseUnknown(func(id string) bool { return known[id] })
	entries, err := os.ReadDir(filepath.Join(m.cfg.StateDir, "vms"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		m.log.Warn("cannot list vm directories", "error", err)
	}
	for _, e := range entries {
		id := e.Name()
		if known[id] {
			m.sweepForkSnapshots(id)
		}
		if known[id] || !e.IsDir() {
			continue
		}
		if _, err := os.Stat(filepath.Join(m.table.vmDir(id), sweepMarker)); err != nil {
			m.log.Warn("a vm directory without a record and not marked for the sweep; left in place", "dir", m.table.vmDir(id))
			continue
		}
		m.log.Warn("removing the files of a deleted vm (a create or delete cut short)", "vm", id)
		m.table.removeDir(id)
	}
}

// sweepForkSnapshots removes the fork snapshots (fork.go) a hypervisor
// that stopped during a fork left in a VM's directory: they hold the
// VM's RAM and vTPM state, and no fork can start from them any more. The
// pattern also takes a fork's prepared vTPM blobs (driver's fork-tpm),
// left only by a fork cut short before its launch read them.
func (m *Manager) sweepForkSnapshots(id string) {
	dirs, _ := filepath.Glob(filepath.Join(m.table.vmDir(id), forkSnapshotPrefix+"*"))
	for _, d := range dirs {
		m.log.Warn("removing a fork snapshot left by a fork cut short", "vm", id, "dir", d)
		if err := os.RemoveAll(d); err != nil {
			m.log.Error("remove a fork snapshot", "dir", d, "error", err)
		}
	}
}
