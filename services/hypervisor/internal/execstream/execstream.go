// Package execstream serves ExecVirtualMachineStream: it pumps one gRPC
// stream into one SSH session in the guest and back. Output is read from the
// SSH channel only as fast as the caller takes it (gRPC flow control), so a
// slow reader slows the command and nothing is cut. Sessions are bounded per
// host (--max-exec-sessions), by idleness (--exec-idle-timeout) and by
// duration (--exec-max-duration); refusals and endings are counted.
package execstream

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/bound"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/sshexec"
)

// Defaults of the bounds.
const (
	DefaultMaxSessions = 64
	DefaultIdleTimeout = 30 * time.Minute
	DefaultMaxDuration = 24 * time.Hour
)

// chunk is the most output one message carries.
const chunk = 32 << 10

// Reasons a session ended, the keys of ExecSessionCounters.ended_total.
const (
	EndExit        = "exit"
	EndClient      = "client"
	EndIdle        = "idle_timeout"
	EndMaxDuration = "max_duration"
	EndShutdown    = "shutdown"
	EndError       = "error"
)

// Config bounds the sessions; zero values take the defaults.
type Config struct {
	MaxSessions int
	IdleTimeout time.Duration
	MaxDuration time.Duration
}

// Opener starts a command in a VM's guest (vm.Manager.OpenExec).
type Opener interface {
	OpenExec(ctx context.Context, id string, opts sshexec.StreamOptions) (*sshexec.Session, error)
}

// Service serves the streams of one host.
type Service struct {
	ctx  context.Context // ends every session: the hypervisor stops
	cfg  Config
	open Opener
	log  *slog.Logger

	slots   chan struct{} // one per open session
	started atomic.Uint64
	refused atomic.Uint64
	mu      sync.Mutex
	ended   map[string]uint64
}

// New returns a Service over open. Its sessions end when ctx does, so that
// an open terminal does not hold the hypervisor's drain for its whole timeout.
func New(ctx context.Context, cfg Config, open Opener, log *slog.Logger) *Service {
	bound.Default(&cfg.MaxSessions, DefaultMaxSessions)
	bound.Default(&cfg.IdleTimeout, DefaultIdleTimeout)
	bound.Default(&cfg.MaxDuration, DefaultMaxDuration)
	return &Service{ctx: ctx, cfg: cfg, open: open, log: log, slots: make(chan struct{}, cfg.MaxSessions),
		ended: map[string]uint64{EndExit: 0, EndClient: 0, EndIdle: 0, EndMaxDuration: 0, EndShutdown: 0, EndError: 0}}
}

// Counters are the sessions since the hypervisor started.
func (s *Service) Counters() *hypervisorv1.ExecSessionCounters {
	s.mu.Lock()
	ended := make(map[string]uint64, len(s.ended))
	for k, v := range s.ended {
		ended[k] = v
	}
	s.mu.Unlock()
	return &hypervisorv1.ExecSessionCounters{
		Open:         int64(len(s.slots)),
		StartedTotal: s.started.Load(),
		RefusedTotal: s.refused.Load(),
		EndedTotal:   ended,
	}
}

func (s *Service) end(reason string) {
	s.mu.Lock()
	s.ended[reason]++
	s.mu.Unlock()
}

// Stream is the server side of one call.
type Stream interface {
	Context() context.Context
	Send(*hypervisorv1.ExecVirtualMachineStreamResponse) error
	Recv() (*hypervisorv1.ExecVirtualMachineStreamRequest, error)
}

// Why a session was ended from this side.
var (
	errIdle        = errors.New("idle")
	errMaxDuration = errors.New("max duration")
	errShutdown    = errors.New("shutdown")
	errClient      = errors.New("client gone")
)

// Serve runs one session: the first message starts it, the last one sent
// is its exit.
func (s *Service) Serve(stream Stream) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	st := first.GetStart()
	if st == nil {
		return apierr.Invalidf("start", "the first message must be start (the command to run)")
	}
	opts, err := startOptions(st)
	if err != nil {
		return err
	}
	select {
	case s.slots <- struct{}{}:
	default:
		s.refused.Add(1)
		return apierr.Errorf(apierr.ResourceExhausted, "the host has %d exec sessions open, the maximum is %d (--max-exec-sessions)", len(s.slots), s.cfg.MaxSessions)
	}
	defer func() { <-s.slots }()

	ctx, cancel := context.WithCancelCause(stream.Context())
	defer cancel(nil)
	maxTimer := time.AfterFunc(s.cfg.MaxDuration, func() { cancel(errMaxDuration) })
	defer maxTimer.Stop()
	defer context.AfterFunc(s.ctx, func() { cancel(errShutdown) })()
	idle := newIdle(s.cfg.IdleTimeout, func() { cancel(errIdle) })
	defer idle.stop()

	sess, err := s.open.OpenExec(ctx, st.GetId(), opts)
	if errors.Is(context.Cause(ctx), errShutdown) {
		err = apierr.Errorf(apierr.Unavailable, "exec session ended: the hypervisor is shutting down")
	}
	if err != nil {
		if sess != nil {
			sess.Close()
		}
		return err
	}
	defer sess.Close()
	s.started.Add(1)

	var sendMu sync.Mutex
	send := func(r *hypervisorv1.ExecVirtualMachineStreamResponse) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		return stream.Send(r)
	}
	var wg sync.WaitGroup
	pump := func(r io.Reader, msg func([]byte) *hypervisorv1.ExecVirtualMachineStreamResponse) {
		defer wg.Done()
		buf := make([]byte, chunk)
		for {
			n, err := r.Read(buf)
			if n > 0 {
				idle.touch()
				// Send blocks while the caller does not read: the SSH
				// window then fills and the guest's command waits.
				if serr := send(msg(append([]byte(nil), buf[:n]...))); serr != nil {
					cancel(errClient)
					return
				}
			}
			if err != nil {
				return
			}
		}
	}
	wg.Add(2)
	go pump(sess.Stdout, func(b []byte) *hypervisorv1.ExecVirtualMachineStreamResponse {
		return &hypervisorv1.ExecVirtualMachineStreamResponse{Kind: &hypervisorv1.ExecVirtualMachineStreamResponse_Stdout{Stdout: b}}
	})
	go pump(sess.Stderr, func(b []byte) *hypervisorv1.ExecVirtualMachineStreamResponse {
		return &hypervisorv1.ExecVirtualMachineStreamResponse{Kind: &hypervisorv1.ExecVirtualMachineStreamResponse_Stderr{Stderr: b}}
	})
	var inErr atomic.Pointer[error] // a bad message from the caller
	go func() {
		if err := s.input(stream, sess, opts.Pty != nil, idle); err != nil {
			inErr.Store(&err)
			cancel(err)
		}
	}()
	wg.Wait()
	exit, werr := sess.Wait()

	switch cause := context.Cause(ctx); {
	case inErr.Load() != nil:
		s.end(EndError)
		return *inErr.Load()
	case errors.Is(cause, errIdle):
		s.end(EndIdle)
		return apierr.Errorf(apierr.Timeout, "exec session ended: no input or output for %s (--exec-idle-timeout)", s.cfg.IdleTimeout)
	case errors.Is(cause, errMaxDuration):
		s.end(EndMaxDuration)
		return apierr.Errorf(apierr.Timeout, "exec session ended: it ran for %s (--exec-max-duration)", s.cfg.MaxDuration)
	case errors.Is(cause, errShutdown):
		s.end(EndShutdown)
		return apierr.Errorf(apierr.Unavailable, "exec session ended: the hypervisor is shutting down")
	case errors.Is(cause, errClient) || stream.Context().Err() != nil:
		s.end(EndClient)
		return context.Cause(stream.Context())
	case werr != nil:
		s.end(EndError)
		return apierr.Errorf(apierr.Unavailable, "vm %s: exec session: %v", st.GetId(), werr)
	}
	s.end(EndExit)
	return send(&hypervisorv1.ExecVirtualMachineStreamResponse{Kind: &hypervisorv1.ExecVirtualMachineStreamResponse_Exit{
		Exit: &hypervisorv1.ExecExit{ExitCode: int32(exit.Code), Signal: exit.Signal},
	}})
}

// input applies the caller's messages in order until its half ends. Stdin
// writes wait while the guest does not read (its window is full): the
// caller's stream then waits too.
func (s *Service) input(stream Stream, sess *sshexec.Session, pty bool, idle *idleTimer) error {
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			// The caller closed its half: stdin ends, output goes on.
			_ = sess.Stdin.Close()
			return nil
		}
		if err != nil {
			return nil // the call is over; Serve sees it in the context
		}
		idle.touch()
		switch k := req.GetKind().(type) {
		case *hypervisorv1.ExecVirtualMachineStreamRequest_Stdin:
			if _, err := sess.Stdin.Write(k.Stdin); err != nil {
				return nil // the command's stdin is gone; its exit follows
			}
		case *hypervisorv1.ExecVirtualMachineStreamRequest_StdinClose:
			_ = sess.Stdin.Close()
		case *hypervisorv1.ExecVirtualMachineStreamRequest_Resize:
			if err := checkResize(k.Resize, pty); err != nil {
				return err
			}
			_ = sess.Resize(k.Resize.GetRows(), k.Resize.GetCols())
		case *hypervisorv1.ExecVirtualMachineStreamRequest_Signal:
			if err := checkSignal(k.Signal); err != nil {
				return err
			}
			_ = sess.Signal(k.Signal)
		case *hypervisorv1.ExecVirtualMachineStreamRequest_Start:
			return apierr.Invalidf("start", "start may only be the first message")
		default:
			return apierr.Invalidf("kind", "an empty message: set one of stdin, resize, signal, stdin_close")
		}
	}
}
