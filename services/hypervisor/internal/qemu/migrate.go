package qemu

import (
	"context"
	"fmt"
	"os"
	"time"
)

// Migration to and from a file, for suspend and resume. QEMU 7.2 has no
// file: transport (8.2+): exec: runs a shell command QEMU writes the stream
// to or reads it from.

// migratePoll is how often a migration's progress is asked for.
const migratePoll = 10 * time.Millisecond

// Stop pauses the guest's vCPUs (stop).
func (m *Monitor) Stop(ctx context.Context) error { return m.run(ctx, "stop", nil) }

// Cont resumes the guest's vCPUs (cont).
func (m *Monitor) Cont(ctx context.Context) error { return m.run(ctx, "cont", nil) }

// MigrateCancel cancels an outgoing migration in progress, if any, and
// waits until it has ended.
func (m *Monitor) MigrateCancel(ctx context.Context) error {
	for cancelled := false; ; {
		st, err := m.QueryMigrate(ctx)
		if err != nil {
			return err
		}
		switch st.Status {
		case "setup", "active", "pre-switchover", "device", "cancelling":
		default:
			return nil
		}
		if !cancelled {
			if err := m.run(ctx, "migrate_cancel", nil); err != nil {
				return err
			}
			cancelled = true
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(migratePoll):
		}
	}
}

// SetMaxBandwidth sets the migration bandwidth cap in bytes per second;
// QEMU's default (~128 MiB/s) makes a save to local disk take seconds.
func (m *Monitor) SetMaxBandwidth(ctx context.Context, bytesPerSecond int64) error {
	return m.runArgs(ctx, "migrate-set-parameters", map[string]any{"max-bandwidth": bytesPerSecond}, nil)
}

// MigrateStatus is query-migrate's answer.
type MigrateStatus struct {
	Status      string `json:"status"` // none, setup, active, completed, failed, cancelled …
	ErrorDesc   string `json:"error-desc"`
	TotalTimeMS int64  `json:"total-time"`
}

// QueryMigrate reports the current (or last) migration.
func (m *Monitor) QueryMigrate(ctx context.Context) (MigrateStatus, error) {
	var st MigrateStatus
	err := m.run(ctx, "query-migrate", &st)
	return st, err
}

// Migrate starts an outgoing migration to uri and waits until it completed
// or failed.
func (m *Monitor) Migrate(ctx context.Context, uri string) error {
	if err := m.runArgs(ctx, "migrate", map[string]any{"uri": uri}, nil); err != nil {
		return err
	}
	return m.waitMigration(ctx)
}

// MigrateIncoming reads the state a QEMU started with -incoming defer waits
// for from uri, and waits until it is loaded (the VM is then paused).
func (m *Monitor) MigrateIncoming(ctx context.Context, uri string) error {
	if err := m.runArgs(ctx, "migrate-incoming", map[string]any{"uri": uri}, nil); err != nil {
		return err
	}
	for {
		st, err := m.Status(ctx)
		if err != nil {
			return err
		}
		switch st {
		case "inmigrate":
		case "paused":
			return nil
		default:
			return fmt.Errorf("incoming migration ended in state %s", st)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(migratePoll):
		}
	}
}

func (m *Monitor) waitMigration(ctx context.Context) error {
	for {
		st, err := m.QueryMigrate(ctx)
		if err != nil {
			return err
		}
		switch st.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("migration %s: %s", st.Status, st.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("migration: %w", ctx.Err())
		case <-time.After(migratePoll):
		}
	}
}

// SnapshotDrive makes the qcow2 file at overlay, which must exist with the
// drive's current image as its backing file, the drive's active layer: the
// image below stops being written (blockdev-snapshot-sync, mode existing,
// so the overlay's relative backing name stays as written).
func (m *Monitor) SnapshotDrive(ctx context.Context, device, overlay string) error {
	return m.runArgs(ctx, "blockdev-snapshot-sync", map[string]any{
		"device": device, "snapshot-file": overlay, "format": "qcow2", "mode": "existing",
	}, nil)
}

// migrationFD is the name the migration's file descriptor has in QEMU.
const migrationFD = "migration"

// MigrateToFile saves the VM's state into f (QEMU writes the descriptor
// itself: no pipe, no writer process) and waits until it completed.
func (m *Monitor) MigrateToFile(ctx context.Context, f *os.File) error {
	if err := m.runFile(ctx, "getfd", map[string]any{"fdname": migrationFD}, f, nil); err != nil {
		return err
	}
	return m.Migrate(ctx, "fd:"+migrationFD)
}

// MigrateIncomingFile loads the state in f into a QEMU started with
// -incoming defer, reading the descriptor itself, and waits until it is
// loaded.
func (m *Monitor) MigrateIncomingFile(ctx context.Context, f *os.File) error {
	if err := m.runFile(ctx, "getfd", map[string]any{"fdname": migrationFD}, f, nil); err != nil {
		return err
	}
	return m.MigrateIncoming(ctx, "fd:"+migrationFD)
}
