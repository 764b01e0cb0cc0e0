package qemu

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// fakeQMP serves QMP like QEMU: one client at a time, the others wait in the
// accept backlog.
type fakeQMP struct {
	t    *testing.T
	path string
	l    net.Listener

	mu    sync.Mutex
	burst int  // STOP events sent before the reply to system_powerdown
	hang  bool // never reply to system_powerdown
}

func newFakeQMP(t *testing.T, path string) *fakeQMP {
	t.Helper()
	l, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeQMP{t: t, path: path, l: l}
	go f.serve()
	t.Cleanup(func() { l.Close() })
	return f
}

func (f *fakeQMP) serve() {
	for {
		c, err := f.l.Accept()
		if err != nil {
			return
		}
		f.handle(c) // serially: QEMU serves one QMP client at a time
	}
}

func (f *fakeQMP) handle(c net.Conn) {
	defer c.Close()
	w := bufio.NewWriter(c)
	send := func(v string) {
		w.WriteString(v + "\r\n")
		w.Flush()
	}
	event := func(name string) {
		send(fmt.Sprintf(`{"timestamp": {"seconds": 1700000000, "microseconds": 250}, "event": %q, "data": {"guest": false, "reason": "host-qmp-quit"}}`, name))
	}
	send(`{"QMP": {"version": {"qemu": {"micro": 22, "minor": 2, "major": 7}, "package": "Debian"}, "capabilities": ["oob"]}}`)
	dec := json.NewDecoder(c)
	for {
		var cmd struct {
			Execute string `json:"execute"`
		}
		if err := dec.Decode(&cmd); err != nil {
			return
		}
		f.mu.Lock()
		burst, hang := f.burst, f.hang
		f.mu.Unlock()
		switch cmd.Execute {
		case "qmp_capabilities":
			send(`{"return": {}}`)
		case "query-status":
			send(`{"return": {"status": "running", "singlestep": false, "running": true}}`)
		case "system_powerdown":
			if hang {
				continue
			}
			for i := 0; i < burst; i++ {
				event("RTC_CHANGE") // not a lifecycle event: filtered, not counted
				event("STOP")
			}
			send(`{"return": {}}`)
			event("POWERDOWN")
		case "quit":
			send(`{"return": {}}`)
			event("SHUTDOWN")
			return
		default:
			send(`{"error": {"class": "CommandNotFound", "desc": "The command ` + cmd.Execute + ` has not been found"}}`)
		}
	}
}

func ctxT(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestConnectWaitsForSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "qmp.sock")
	go func() {
		time.Sleep(300 * time.Millisecond)
		newFakeQMP(t, path)
	}()
	m, err := Connect(ctxT(t, 5*time.Second), path)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if v := m.Version(); v != (Version{7, 2, 22}) {
		t.Errorf("version %v", v)
	}
	st, err := m.Status(ctxT(t, 2*time.Second))
	if err != nil || st != "running" {
		t.Errorf("Status = %q, %v", st, err)
	}
}

func TestConnectGivesUpWithContext(t *testing.T) {
	path := filepath.Join(t.TempDir(), "qmp.sock")
	start := time.Now()
	_, err := Connect(ctxT(t, 200*time.Millisecond), path)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err %v, want deadline exceeded", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("took %v", d)
	}
}

func TestSecondClientWaitsUntilFirstCloses(t *testing.T) {
	path := filepath.Join(t.TempDir(), "qmp.sock")
	newFakeQMP(t, path)
	first, err := Connect(ctxT(t, 5*time.Second), path)
	if err != nil {
		t.Fatal(err)
	}
	// QEMU leaves a second client in the backlog: the handshake must not hang.
	if _, err := Connect(ctxT(t, 300*time.Millisecond), path); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("second client while the first is connected: %v", err)
	}
	if err := first.Close(); err != nil {
		t.Fatal(err)
	}
	if _, ok := <-first.Events(); ok {
		t.Error("Events not closed after Close")
	}
	if _, err := first.Status(ctxT(t, time.Second)); !errors.Is(err, ErrDisconnected) {
		t.Errorf("Status after Close: %v", err)
	}
	second, err := Connect(ctxT(t, 5*time.Second), path)
	if err != nil {
		t.Fatalf("connect after Close: %v", err)
	}
	defer second.Close()
	if _, err := second.Status(ctxT(t, 2*time.Second)); err != nil {
		t.Fatal(err)
	}
}

func TestEventsFilteredAndOverflowCounted(t *testing.T) {
	path := filepath.Join(t.TempDir(), "qmp.sock")
	f := newFakeQMP(t, path)
	f.mu.Lock()
	f.burst = 100
	f.mu.Unlock()
	m, err := Connect(ctxT(t, 5*time.Second), path)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Powerdown(ctxT(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	// 100 STOP + POWERDOWN into a buffer of 64 nobody reads.
	deadline := time.Now().Add(5 * time.Second)
	for m.Dropped() != 101-EventBuffer && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if got := m.Dropped(); got != 101-EventBuffer {
		t.Fatalf("dropped %d, want %d", got, 101-EventBuffer)
	}
	e := <-m.Events()
	if e.Name != "STOP" || !e.At.Equal(time.Unix(1700000000, 250000)) || e.Data["reason"] != "host-qmp-quit" {
		t.Errorf("first event %+v", e)
	}
	for range EventBuffer - 1 {
		if e := <-m.Events(); e.Name != "STOP" {
			t.Fatalf("got %s, want only STOP (RTC_CHANGE filtered)", e.Name)
		}
	}
}

func TestQuitDeliversShutdownAndEnds(t *testing.T) {
	path := filepath.Join(t.TempDir(), "qmp.sock")
	newFakeQMP(t, path)
	m, err := Connect(ctxT(t, 5*time.Second), path)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Quit(ctxT(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	var names []string
	for e := range m.Events() { // closed when the connection ends
		names = append(names, e.Name)
	}
	if len(names) != 1 || names[0] != "SHUTDOWN" {
		t.Errorf("events %v, want [SHUTDOWN]", names)
	}
	<-m.Done()
	if err := m.Quit(ctxT(t, time.Second)); !errors.Is(err, ErrDisconnected) {
		t.Errorf("Quit after the end: %v", err)
	}
	if err := m.Close(); err != nil {
		t.Errorf("Close after QEMU left: %v", err)
	}
}

func TestCommandHonoursContextAndCloseUnblocks(t *testing.T) {
	path := filepath.Join(t.TempDir(), "qmp.sock")
	f := newFakeQMP(t, path)
	f.mu.Lock()
	f.hang = true
	f.mu.Unlock()
	m, err := Connect(ctxT(t, 5*time.Second), path)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Powerdown(ctxT(t, 200*time.Millisecond)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Powerdown without reply: %v", err)
	}
	done := make(chan error, 1)
	go func() { done <- m.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Error(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close hangs behind a command without reply")
	}
}

func TestQMPErrorReply(t *testing.T) {
	path := filepath.Join(t.TempDir(), "qmp.sock")
	newFakeQMP(t, path)
	m, err := Connect(ctxT(t, 5*time.Second), path)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	err = m.run(ctxT(t, 2*time.Second), "no-such-command", nil)
	if err == nil || errors.Is(err, ErrDisconnected) {
		t.Fatalf("err %v, want QEMU's error", err)
	}
	// The connection survives a failed command.
	if _, err := m.Status(ctxT(t, 2*time.Second)); err != nil {
		t.Fatal(err)
	}
}
