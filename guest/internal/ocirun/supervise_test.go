package ocirun

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fakeClock reports every After call on waits and fires it when told.
type fakeClock struct {
	mu    sync.Mutex
	now   time.Time
	waits chan fakeWait
}

type fakeWait struct {
	d    time.Duration
	fire chan time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{now: time.Unix(1000, 0), waits: make(chan fakeWait, 16)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func (c *fakeClock) After(d time.Duration) <-chan time.Time {
	ch := make(chan time.Time, 1)
	c.waits <- fakeWait{d, ch}
	return ch
}

type fakeInst struct {
	pid  int
	exit chan Exit
	sigs chan unix.Signal
}

func (f *fakeInst) Pid() int   { return f.pid }
func (f *fakeInst) Wait() Exit { return <-f.exit }
func (f *fakeInst) Signal(s unix.Signal) bool {
	f.sigs <- s
	return true
}

// harness runs a Supervisor whose starts come from the test.
type harness struct {
	t      *testing.T
	clock  *fakeClock
	starts chan *fakeInst
	errs   chan error // a start's error instead of an instance, when sent first
	mu     sync.Mutex
	lines  []string
	sup    *Supervisor
}

// newHarness starts the supervisor; its first starts fail with startErrs.
func newHarness(t *testing.T, startErrs ...error) *harness {
	h := &harness{t: t, clock: newFakeClock(), starts: make(chan *fakeInst, 1), errs: make(chan error, len(startErrs))}
	for _, err := range startErrs {
		h.errs <- err
	}
	pid := 100
	h.sup = &Supervisor{
		Name:  "entrypoint",
		Clock: h.clock,
		Logf: func(f string, a ...any) {
			h.mu.Lock()
			h.lines = append(h.lines, fmt.Sprintf(f, a...))
			h.mu.Unlock()
		},
		Start: func() (Instance, error) {
			select {
			case err := <-h.errs:
				return nil, err
			default:
			}
			pid++
			in := &fakeInst{pid: pid, exit: make(chan Exit, 1), sigs: make(chan unix.Signal, 4)}
			h.starts <- in
			return in, nil
		},
	}
	go h.sup.Run()
	t.Cleanup(func() {
		select {
		case <-h.sup.Done():
		case <-time.After(5 * time.Second):
			t.Error("supervisor still running at the end")
		}
	})
	return h
}

func (h *harness) started() *fakeInst {
	h.t.Helper()
	select {
	case in := <-h.starts:
		return in
	case <-time.After(5 * time.Second):
		h.t.Fatal("no start")
		return nil
	}
}

func (h *harness) waitFor(want time.Duration) fakeWait {
	h.t.Helper()
	select {
	case w := <-h.clock.waits:
		if w.d != want {
			h.t.Fatalf("backoff %s, want %s", w.d, want)
		}
		return w
	case <-time.After(5 * time.Second):
		h.t.Fatalf("no backoff wait (want %s)", want)
		return fakeWait{}
	}
}

func (h *harness) lastLine() string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.lines[len(h.lines)-1]
}

func TestSupervisorBackoffDoublesToMaxAndResets(t *testing.T) {
	h := newHarness(t)
	for _, want := range []time.Duration{1, 2, 4, 8, 16, 30, 30} {
		in := h.started()
		h.clock.advance(100 * time.Millisecond)
		in.exit <- Exit{Code: 3}
		w := h.waitFor(want * time.Second)
		if l := h.lastLine(); l != fmt.Sprintf("entrypoint exited with status 3 after 100ms; restarting in %s", want*time.Second) {
			t.Errorf("line %q", l)
		}
		w.fire <- time.Time{}
	}
	// A run that lasted the maximum backoff is no crash loop: back to 1 s.
	in := h.started()
	h.clock.advance(MaxBackoff)
	in.exit <- Exit{Signal: unix.SIGSEGV}
	w := h.waitFor(time.Second)
	if l := h.lastLine(); l != "entrypoint killed by signal SEGV after 30s; restarting in 1s" {
		t.Errorf("line %q", l)
	}
	w.fire <- time.Time{}
	// A clean exit ends it.
	in = h.started()
	in.exit <- Exit{}
	<-h.sup.Done()
	if l := h.lastLine(); l != "entrypoint exited with status 0 after 0s; not restarting it" {
		t.Errorf("line %q", l)
	}
	if err := h.sup.FirstError(); err != nil {
		t.Errorf("first start: %v", err)
	}
}

func TestSupervisorRetriesAFailedStart(t *testing.T) {
	h := newHarness(t, errors.New("no such file"))
	w := h.waitFor(time.Second)
	if err := h.sup.FirstError(); err == nil || !strings.Contains(h.lastLine(), "entrypoint did not start: no such file; retrying in 1s") {
		t.Errorf("first error %v, line %q", err, h.lastLine())
	}
	w.fire <- time.Time{}
	in := h.started()
	in.exit <- Exit{}
}

func TestSupervisorStop(t *testing.T) {
	h := newHarness(t)
	in := h.started()
	<-h.sup.Started()
	stopped := make(chan struct{})
	go func() {
		h.sup.Stop(time.Minute)
		close(stopped)
	}()
	if s := <-in.sigs; s != unix.SIGTERM {
		t.Fatalf("signal %v, want SIGTERM", s)
	}
	// Stop's grace timer is armed; the instance ends before it fires.
	h.clock.waitsDrain(t, 1)
	in.exit <- Exit{Signal: unix.SIGTERM}
	<-stopped
	if l := h.lastLine(); l != "entrypoint killed by signal TERM after 0s (stopped)" {
		t.Errorf("line %q", l)
	}
}

func TestSupervisorStopKillsAfterGrace(t *testing.T) {
	h := newHarness(t)
	in := h.started()
	go h.sup.Stop(time.Minute)
	if s := <-in.sigs; s != unix.SIGTERM {
		t.Fatalf("signal %v, want SIGTERM", s)
	}
	h.waitFor(time.Minute).fire <- time.Time{}
	if s := <-in.sigs; s != unix.SIGKILL {
		t.Fatalf("signal %v, want SIGKILL", s)
	}
	in.exit <- Exit{Signal: unix.SIGKILL}
	<-h.sup.Done()
}

// waitsDrain takes n pending After calls without firing them.
func (c *fakeClock) waitsDrain(t *testing.T, n int) {
	t.Helper()
	for range n {
		select {
		case <-c.waits:
		case <-time.After(5 * time.Second):
			t.Fatal("no timer armed")
		}
	}
}

func TestExitString(t *testing.T) {
	for _, c := range []struct {
		e    Exit
		want string
		ok   bool
	}{
		{Exit{}, "exited with status 0", true},
		{Exit{Code: 2}, "exited with status 2", false},
		{Exit{Signal: unix.SIGKILL}, "killed by signal KILL", false},
		{Exit{Err: errors.New("x")}, "lost (x)", false},
	} {
		if got := c.e.String(); got != c.want || c.e.Success() != c.ok {
			t.Errorf("%+v: %q %v, want %q %v", c.e, got, c.e.Success(), c.want, c.ok)
		}
	}
}
