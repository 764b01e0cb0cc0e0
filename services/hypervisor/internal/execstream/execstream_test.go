package execstream

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"testing/synctest"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/sshexec"
)

// stream is the caller's side: the messages it sends, then EOF.
type stream struct {
	ctx context.Context
	in  chan *hypervisorv1.ExecVirtualMachineStreamRequest
}

func (s *stream) Context() context.Context { return s.ctx }
func (s *stream) Send(*hypervisorv1.ExecVirtualMachineStreamResponse) error {
	return nil
}
func (s *stream) Recv() (*hypervisorv1.ExecVirtualMachineStreamRequest, error) {
	select {
	case m, ok := <-s.in:
		if !ok {
			return nil, io.EOF
		}
		return m, nil
	case <-s.ctx.Done():
		return nil, s.ctx.Err()
	}
}

func newStream(ctx context.Context, msgs ...*hypervisorv1.ExecVirtualMachineStreamRequest) *stream {
	s := &stream{ctx: ctx, in: make(chan *hypervisorv1.ExecVirtualMachineStreamRequest, len(msgs))}
	for _, m := range msgs {
		s.in <- m
	}
	return s
}

func start(st *hypervisorv1.ExecStart) *hypervisorv1.ExecVirtualMachineStreamRequest {
	return &hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_Start{Start: st}}
}

// opener is the port to the guests: it holds each session until ctx ends.
type opener struct{ opened chan string }

func (o *opener) OpenExec(ctx context.Context, id string, _ sshexec.StreamOptions) (*sshexec.Session, error) {
	o.opened <- id
	<-ctx.Done()
	return nil, apierr.Errorf(apierr.Timeout, "cancelled")
}

func TestRefusedAtBound(t *testing.T) {
	o := &opener{opened: make(chan string, 3)}
	s := New(context.Background(), Config{MaxSessions: 1}, o, slog.New(slog.DiscardHandler))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(newStream(ctx, start(&hypervisorv1.ExecStart{Id: "a"}))) }()
	<-o.opened

	// Bounded, so that a missing bound fails here instead of hanging.
	bctx, bcancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer bcancel()
	err := s.Serve(newStream(bctx, start(&hypervisorv1.ExecStart{Id: "b"})))
	if apierr.CodeOf(err) != apierr.ResourceExhausted {
		t.Fatalf("second session: %v, want resource_exhausted", err)
	}
	if c := s.Counters(); c.GetOpen() != 1 || c.GetRefusedTotal() != 1 {
		t.Fatalf("counters %v", c)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the first session did not end with its caller")
	}
	if c := s.Counters(); c.GetOpen() != 0 {
		t.Fatalf("open after the end: %d", c.GetOpen())
	}
	// The slot is free again.
	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = s.Serve(newStream(ctx, start(&hypervisorv1.ExecStart{Id: "c"}))) }()
	select {
	case id := <-o.opened:
		if id != "c" {
			t.Fatalf("opened %s", id)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a session after the bound freed was not opened")
	}
}

// Bad starts are refused before anything is opened.
func TestBadStart(t *testing.T) {
	o := &opener{opened: make(chan string, 10)}
	s := New(context.Background(), Config{}, o, slog.New(slog.DiscardHandler))
	stdin := &hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_Stdin{Stdin: []byte("x")}}
	for name, first := range map[string]*hypervisorv1.ExecVirtualMachineStreamRequest{
		"not start": stdin,
		"no id":     start(&hypervisorv1.ExecStart{Command: []string{"true"}}),
		"nul":       start(&hypervisorv1.ExecStart{Id: "a", Command: []string{"a\x00"}}),
		"env name":  start(&hypervisorv1.ExecStart{Id: "a", Env: map[string]string{"A=B": "c"}}),
		"env nul":   start(&hypervisorv1.ExecStart{Id: "a", Env: map[string]string{"A": "\x00"}}),
		"pty size":  start(&hypervisorv1.ExecStart{Id: "a", Pty: &hypervisorv1.ExecPty{Rows: 20000}}),
		"pty term":  start(&hypervisorv1.ExecStart{Id: "a", Pty: &hypervisorv1.ExecPty{Term: "x;rm -rf"}}),
	} {
		err := s.Serve(newStream(context.Background(), first))
		if apierr.CodeOf(err) != apierr.InvalidRequest {
			t.Errorf("%s: %v, want invalid_request", name, err)
		}
	}
	if len(o.opened) != 0 || s.Counters().GetStartedTotal() != 0 {
		t.Fatal("a bad start opened a session")
	}
	if err := checkSignal("SIGINT"); err == nil {
		t.Error("SIGINT accepted: names go without SIG")
	}
	if err := checkResize(&hypervisorv1.ExecWindowSize{Rows: 10, Cols: 10}, false); err == nil {
		t.Error("resize without a pty accepted")
	}
}

// The hypervisor stopping ends open sessions at once, with unavailable.
func TestShutdownEndsSessions(t *testing.T) {
	o := &opener{opened: make(chan string, 1)}
	ctx, stop := context.WithCancel(context.Background())
	s := New(ctx, Config{}, o, slog.New(slog.DiscardHandler))
	done := make(chan error, 1)
	go func() { done <- s.Serve(newStream(context.Background(), start(&hypervisorv1.ExecStart{Id: "a"}))) }()
	<-o.opened
	stop()
	select {
	case err := <-done:
		if apierr.CodeOf(err) != apierr.Unavailable {
			t.Fatalf("session: %v, want unavailable", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the session outlived the hypervisor")
	}
}

// TestIdleTimer: touches, each well within the timeout of the one before,
// keep the timer from firing for five timeouts; without them it fires. It
// runs in a synctest bubble: the sleeps advance the bubble's clock, not the
// machine's, so a loaded machine cannot stretch the gaps between touches.
func TestIdleTimer(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		const timeout = 200 * time.Millisecond
		fired := make(chan struct{})
		it := newIdle(timeout, func() { close(fired) })
		defer it.stop()
		for i := range 25 {
			time.Sleep(timeout / 10) // the bubble's clock
			it.touch()
			synctest.Wait()
			select {
			case <-fired:
				t.Fatalf("fired while touched, after touch %d (every %s, timeout %s)", i, timeout/10, timeout)
			default:
			}
		}
		time.Sleep(timeout + time.Millisecond) // idle for a whole timeout
		synctest.Wait()
		select {
		case <-fired:
		default:
			t.Fatal("did not fire once idle")
		}
	})
}
