package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/digitalocean/go-qemu/qmp"
)

// QMP timing (contract §3.4: 20 ms poll, 2 s dial timeout).
const (
	connectPoll = 20 * time.Millisecond
	dialTimeout = 2 * time.Second
	// EventBuffer is the capacity of Monitor.Events.
	EventBuffer = 64
)

// ErrDisconnected means the QMP connection is gone (Close, or QEMU exited).
var ErrDisconnected = errors.New("qmp: disconnected")

// deliveredEvents are the lifecycle events; QEMU's others are dropped silently.
var deliveredEvents = map[string]bool{"SHUTDOWN": true, "RESET": true, "STOP": true, "POWERDOWN": true}

// Event is a QMP lifecycle event.
type Event struct {
	Name string
	Data map[string]any
	At   time.Time // QEMU's timestamp
}

// Monitor is a QMP connection to one QEMU. QEMU serves one QMP client at a
// time: Close it so that another (a restarted hypervisor) can connect.
type Monitor struct {
	mon     *qmp.SocketMonitor
	events  chan Event
	dropped atomic.Uint64
	done    chan struct{}

	closeOnce sync.Once
	closeErr  error
}

// Connect dials socket until QEMU accepts and completes the QMP handshake,
// retrying while the socket does not exist yet or QEMU serves another client.
func Connect(ctx context.Context, socket string) (*Monitor, error) {
	for {
		m, err := connectOnce(ctx, socket)
		if err == nil {
			return m, nil
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("qmp %s: %w (last error: %v)", socket, ctx.Err(), err)
		case <-time.After(connectPoll):
		}
	}
}

func connectOnce(ctx context.Context, socket string) (*Monitor, error) {
	timeout := dialTimeout
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < timeout {
		timeout = max(time.Until(dl), time.Millisecond)
	}
	mon, err := qmp.NewSocketMonitor("unix", socket, timeout)
	if err != nil {
		return nil, err
	}
	// The handshake has no timeout of its own and blocks while another client
	// holds QMP (QEMU leaves us in the accept backlog).
	res := make(chan error, 1)
	go func() { res <- mon.Connect() }()
	select {
	case err := <-res:
		if err != nil {
			_ = mon.Disconnect()
			return nil, fmt.Errorf("handshake: %w", err)
		}
	case <-ctx.Done():
		_ = mon.Disconnect()
		if <-res == nil {
			// The handshake won the race: disconnect again, now that the
			// listener runs, so its goroutine ends.
			_ = mon.Disconnect()
		}
		return nil, ctx.Err()
	}
	// Subscribe before any command: go-qemu only forwards events while
	// someone listens, and a reader that stalls stalls command replies too.
	src, err := mon.Events(context.Background())
	if err != nil {
		_ = mon.Disconnect()
		return nil, err
	}
	m := &Monitor{mon: mon, events: make(chan Event, EventBuffer), done: make(chan struct{})}
	go m.pump(src)
	return m, nil
}

// pump drains go-qemu's unbuffered event channel until the connection ends.
func (m *Monitor) pump(src <-chan qmp.Event) {
	defer close(m.done)
	defer close(m.events)
	for e := range src {
		if !deliveredEvents[e.Event] {
			continue
		}
		ev := Event{Name: e.Event, Data: e.Data, At: time.Unix(e.Timestamp.Seconds, e.Timestamp.Microseconds*1000)}
		select {
		case m.events <- ev:
		default:
			m.dropped.Add(1)
		}
	}
}

// Events delivers SHUTDOWN, RESET, STOP and POWERDOWN (buffer EventBuffer;
// overflow is dropped and counted). It is closed when the connection ends.
func (m *Monitor) Events() <-chan Event { return m.events }

// Dropped counts events lost to a full Events buffer.
func (m *Monitor) Dropped() uint64 { return m.dropped.Load() }

// Done is closed when the QMP connection has ended (Close, or QEMU exited).
func (m *Monitor) Done() <-chan struct{} { return m.done }

// Version is the QEMU version from the QMP greeting.
func (m *Monitor) Version() Version {
	if m.mon.Version == nil {
		return Version{}
	}
	q := m.mon.Version.QEMU
	return Version{Major: q.Major, Minor: q.Minor, Micro: q.Micro}
}

// Powerdown presses the ACPI power button (system_powerdown). It returns once
// QEMU has accepted the command; the guest may ignore it.
func (m *Monitor) Powerdown(ctx context.Context) error {
	return m.run(ctx, "system_powerdown", nil)
}

// Status returns the run state from query-status: "running", "paused",
// "shutdown", "inmigrate", ...
func (m *Monitor) Status(ctx context.Context) (string, error) {
	var st struct {
		Status string `json:"status"`
	}
	if err := m.run(ctx, "query-status", &st); err != nil {
		return "", err
	}
	return st.Status, nil
}

// Quit ends QEMU at once (quit). QEMU emits SHUTDOWN and closes the connection.
func (m *Monitor) Quit(ctx context.Context) error {
	if m.closed() {
		return ErrDisconnected
	}
	err := m.run(ctx, "quit", nil)
	if errors.Is(err, ErrDisconnected) {
		return nil // QEMU went away before its reply reached us: what we asked for
	}
	return err
}

// Close releases the QMP socket for the next client. Events is closed when it returns.
func (m *Monitor) Close() error {
	m.closeOnce.Do(func() {
		if err := m.mon.Disconnect(); err != nil && !errors.Is(err, net.ErrClosed) {
			m.closeErr = err
		}
	})
	<-m.done
	return m.closeErr
}

// closed reports whether the connection has ended. The non-blocking receive
// is proc.Process.Exited's too; kept: a four-line idiom, not worth a
// package.
func (m *Monitor) closed() bool {
	select {
	case <-m.done:
		return true
	default:
		return false
	}
}

// run executes cmd and decodes its "return" member into out (if not nil).
func (m *Monitor) run(ctx context.Context, cmd string, out any) error {
	return m.runArgs(ctx, cmd, nil, out)
}

// runArgs is run with the command's arguments.
func (m *Monitor) runArgs(ctx context.Context, cmd string, args map[string]any, out any) error {
	return m.runFile(ctx, cmd, args, nil, out)
}

// runFile is runArgs passing file's descriptor along (SCM_RIGHTS), for
// getfd; nil passes none.
func (m *Monitor) runFile(ctx context.Context, cmd string, args map[string]any, file *os.File, out any) error {
	if m.closed() {
		return fmt.Errorf("qmp %s: %w", cmd, ErrDisconnected)
	}
	c := qmp.Command{Execute: cmd}
	if args != nil { // a nil map would be sent as "arguments": null
		c.Args = args
	}
	req, err := json.Marshal(c)
	if err != nil {
		return err
	}
	type result struct {
		raw []byte
		err error
	}
	ch := make(chan result, 1)
	// go-qemu's Run has no context; on ctx expiry it finishes in the
	// background (it serialises commands, so replies never get mixed up).
	go func() {
		var raw []byte
		var err error
		if file != nil {
			raw, err = m.mon.RunWithFile(req, file)
		} else {
			raw, err = m.mon.Run(req)
		}
		ch <- result{raw, err}
	}()
	var r result
	select {
	case r = <-ch:
	case <-ctx.Done():
		return fmt.Errorf("qmp %s: %w", cmd, ctx.Err())
	}
	if r.err != nil {
		// A closed reply stream surfaces as a JSON error: name the real cause.
		select {
		case <-m.done:
			return fmt.Errorf("qmp %s: %w", cmd, ErrDisconnected)
		case <-time.After(100 * time.Millisecond):
		}
		return fmt.Errorf("qmp %s: %w", cmd, r.err)
	}
	if out == nil {
		return nil
	}
	var resp struct {
		Return json.RawMessage `json:"return"`
	}
	if err := json.Unmarshal(r.raw, &resp); err != nil {
		return fmt.Errorf("qmp %s: %w", cmd, err)
	}
	if err := json.Unmarshal(resp.Return, out); err != nil {
		return fmt.Errorf("qmp %s: decode reply: %w", cmd, err)
	}
	return nil
}
