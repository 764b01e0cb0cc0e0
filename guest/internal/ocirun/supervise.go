package ocirun

import (
	"fmt"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Restart backoff: the first restart after 1 s, doubling up to 30 s; a run
// that lasted MaxBackoff starts the count over.
const (
	MinBackoff = time.Second
	MaxBackoff = 30 * time.Second
)

// Exit is how one run ended.
type Exit struct {
	Code   int         // exit status, when Signal is 0
	Signal unix.Signal // the signal that killed it, or 0
	Err    error       // wait(2) itself failed
}

func (e Exit) String() string {
	switch {
	case e.Err != nil:
		return fmt.Sprintf("lost (%v)", e.Err)
	case e.Signal != 0:
		return "killed by signal " + strings.TrimPrefix(unix.SignalName(e.Signal), "SIG")
	}
	return fmt.Sprintf("exited with status %d", e.Code)
}

// Success is a clean exit: 0, not a signal.
func (e Exit) Success() bool { return e.Err == nil && e.Signal == 0 && e.Code == 0 }

// exitOf reads a wait status.
func exitOf(ws syscall.WaitStatus) Exit {
	if ws.Signaled() {
		return Exit{Signal: ws.Signal()}
	}
	return Exit{Code: ws.ExitStatus()}
}

// Instance is one started run of the supervised program.
type Instance interface {
	Pid() int
	Wait() Exit                  // blocks until it ended
	Signal(sig unix.Signal) bool // to everything it started; false once ended
}

// Clock is time for the supervisor; tests pass a fake one.
type Clock interface {
	Now() time.Time
	After(d time.Duration) <-chan time.Time
}

type realClock struct{}

func (realClock) Now() time.Time                         { return time.Now() }
func (realClock) After(d time.Duration) <-chan time.Time { return time.After(d) }

// Supervisor runs a program, restarting it after a failure (a non-zero
// status or a signal) with a backoff; a clean exit ends it.
type Supervisor struct {
	Name  string // in its console lines: "entrypoint"
	Start func() (Instance, error)
	Logf  func(format string, args ...any)
	Clock Clock         // nil: the real one
	Min   time.Duration // 0: MinBackoff
	Max   time.Duration // 0: MaxBackoff

	once        sync.Once
	startedOnce sync.Once
	started     chan struct{} // closed after the first start attempt
	firstErr    error
	stop        chan struct{}
	stopOnce    sync.Once
	done        chan struct{}
	mu          sync.Mutex
	cur         Instance // the running instance, nil between runs
}

func (s *Supervisor) init() {
	s.once.Do(func() {
		s.started = make(chan struct{})
		s.stop = make(chan struct{})
		s.done = make(chan struct{})
		if s.Clock == nil {
			s.Clock = realClock{}
		}
		if s.Min <= 0 {
			s.Min = MinBackoff
		}
		if s.Max <= 0 {
			s.Max = MaxBackoff
		}
	})
}

// Started is closed once the first start was tried; FirstError says how.
func (s *Supervisor) Started() <-chan struct{} { s.init(); return s.started }

// FirstError is the first start's error (valid once Started is closed).
func (s *Supervisor) FirstError() error { <-s.Started(); return s.firstErr }

func (s *Supervisor) markStarted(err error) {
	s.startedOnce.Do(func() {
		s.firstErr = err
		close(s.started)
	})
}

// Done is closed when Run returned.
func (s *Supervisor) Done() <-chan struct{} { s.init(); return s.done }

// Run supervises until a clean exit or Stop.
func (s *Supervisor) Run() {
	s.init()
	defer close(s.done)
	defer s.markStarted(nil) // stopped before the first start
	delay := s.Min
	for !s.stopping() {
		begin := s.Clock.Now()
		inst, err := s.Start()
		s.markStarted(err)
		var lasted time.Duration
		if err != nil {
			s.Logf("%s did not start: %v; retrying in %s", s.Name, err, delay)
		} else {
			s.setCur(inst)
			s.Logf("%s started, pid %d", s.Name, inst.Pid())
			ex := inst.Wait()
			s.setCur(nil)
			lasted = s.Clock.Now().Sub(begin)
			if s.stopping() {
				s.Logf("%s %s after %s (stopped)", s.Name, ex, lasted.Round(time.Millisecond))
				return
			}
			if ex.Success() {
				s.Logf("%s %s after %s; not restarting it", s.Name, ex, lasted.Round(time.Millisecond))
				return
			}
			if lasted >= s.Max {
				delay = s.Min // it ran a while: not a crash loop
			}
			s.Logf("%s %s after %s; restarting in %s", s.Name, ex, lasted.Round(time.Millisecond), delay)
		}
		select {
		case <-s.stop:
			return
		case <-s.Clock.After(delay):
		}
		delay = min(2*delay, s.Max)
	}
}

// setCur records the running instance; one that started while Stop ran is
// sent its SIGTERM here (under mu, Stop sees either it or the stop).
func (s *Supervisor) setCur(i Instance) {
	s.mu.Lock()
	s.cur = i
	late := i != nil && s.stopping()
	s.mu.Unlock()
	if late {
		i.Signal(unix.SIGTERM)
	}
}

func (s *Supervisor) stopping() bool {
	select {
	case <-s.stop:
		return true
	default:
		return false
	}
}

// Stop ends supervision: SIGTERM to the running instance, SIGKILL after
// grace, and waits for Run to return (bounded by another grace).
func (s *Supervisor) Stop(grace time.Duration) {
	s.init()
	s.mu.Lock()
	s.stopOnce.Do(func() { close(s.stop) })
	cur := s.cur
	s.mu.Unlock()
	if cur != nil {
		cur.Signal(unix.SIGTERM)
	}
	select {
	case <-s.done:
		return
	case <-s.Clock.After(grace):
	}
	s.mu.Lock()
	cur = s.cur
	s.mu.Unlock()
	if cur != nil {
		cur.Signal(unix.SIGKILL)
	}
	select {
	case <-s.done:
	case <-s.Clock.After(grace):
	}
}
