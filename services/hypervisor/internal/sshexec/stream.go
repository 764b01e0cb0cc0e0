package sshexec

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"golang.org/x/crypto/ssh"
)

// Pty is the terminal a streamed session asks the guest for.
type Pty struct {
	Term       string
	Rows, Cols uint32
}

// StreamOptions say what a streamed session runs.
type StreamOptions struct {
	// Argv is quoted word by word (Quote); empty runs the guest's shell.
	Argv []string
	// Pty, if set, runs it on a pseudo-terminal (stderr merged into stdout).
	Pty *Pty
	// Env adds to the command's environment ("env" requests).
	Env map[string]string
}

// Session is a command running in the guest with its streams open. Read
// Stdout and Stderr to EOF, then Wait. Output is not buffered beyond the SSH
// channel's window: a reader that stops reading stops the command's writes,
// nothing is dropped.
type Session struct {
	Stdin          io.WriteCloser
	Stdout, Stderr io.Reader

	conn   net.Conn
	client *ssh.Client
	sess   *ssh.Session
	stop   func() bool

	closeOnce sync.Once
	onClose   []func()
}

// OnClose runs f once the session is closed (e.g. to release a hold on the
// VM's idleness for as long as a session is open).
func (s *Session) OnClose(f func()) { s.onClose = append(s.onClose, f) }

// Exit is how a streamed command ended.
type Exit struct {
	// Code is the exit status, 128+n for a command killed by signal n.
	Code int
	// Signal names the signal that killed it ("TERM"), else "".
	Signal string
}

// ErrNoExitStatus is a session the guest ended without saying how the
// command did (the guest's SSH server or the connection went away).
var ErrNoExitStatus = errors.New("the guest ended the session without an exit status")

// handshake logs in as root over conn; until the returned stop is called, ctx
// ending closes conn.
func handshake(ctx context.Context, conn net.Conn, keyPEM []byte, pin PinFile) (*ssh.Client, func() bool, error) {
	signer, err := ssh.ParsePrivateKey(keyPEM)
	if err != nil {
		return nil, nil, fmt.Errorf("per-VM key: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { _ = conn.Close() })
	_ = conn.SetDeadline(time.Now().Add(HandshakeTimeout))
	cc, chans, reqs, err := ssh.NewClientConn(conn, conn.RemoteAddr().String(), &ssh.ClientConfig{
		User:            "root",
		Auth:            []ssh.AuthMethod{ssh.PublicKeys(signer)},
		HostKeyCallback: pin.callback(),
		Timeout:         HandshakeTimeout,
	})
	if err != nil {
		stop()
		if ctx.Err() != nil {
			return nil, nil, ctx.Err()
		}
		return nil, nil, fmt.Errorf("ssh handshake: %w", err)
	}
	_ = conn.SetDeadline(time.Time{})
	return ssh.NewClient(cc, chans, reqs), stop, nil
}

// Open logs in as root over conn and starts opts' command with its streams
// open. The session lives until Close or until ctx ends (which closes conn).
func Open(ctx context.Context, conn net.Conn, keyPEM []byte, pin PinFile, opts StreamOptions) (_ *Session, err error) {
	defer func() {
		if err != nil {
			conn.Close()
		}
	}()
	client, stop, err := handshake(ctx, conn, keyPEM, pin)
	if err != nil {
		return nil, err
	}
	s := &Session{conn: conn, client: client, stop: stop}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	if s.sess, err = client.NewSession(); err != nil {
		return nil, fmt.Errorf("ssh session: %w", err)
	}
	for k, v := range opts.Env {
		if err := s.sess.Setenv(k, v); err != nil {
			return nil, fmt.Errorf("the guest refused env %s: %w", k, err)
		}
	}
	if p := opts.Pty; p != nil {
		if err := s.sess.RequestPty(p.Term, int(p.Rows), int(p.Cols), ssh.TerminalModes{}); err != nil {
			return nil, fmt.Errorf("the guest refused a pty: %w", err)
		}
	}
	if s.Stdin, err = s.sess.StdinPipe(); err != nil {
		return nil, err
	}
	if s.Stdout, err = s.sess.StdoutPipe(); err != nil {
		return nil, err
	}
	if s.Stderr, err = s.sess.StderrPipe(); err != nil {
		return nil, err
	}
	if len(opts.Argv) == 0 {
		err = s.sess.Shell()
	} else {
		err = s.sess.Start(Quote(opts.Argv))
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("ssh start: %w", err)
	}
	return s, nil
}

// Resize tells the guest's pty its new size.
func (s *Session) Resize(rows, cols uint32) error {
	return s.sess.WindowChange(int(rows), int(cols))
}

// Signal sends a signal by name ("INT") to the command's process group.
func (s *Session) Signal(name string) error {
	return s.sess.Signal(ssh.Signal(name))
}

// Wait waits for the command's exit status; call it after Stdout and
// Stderr reached EOF.
func (s *Session) Wait() (Exit, error) {
	err := s.sess.Wait()
	var exit *ssh.ExitError
	var missing *ssh.ExitMissingError
	switch {
	case err == nil:
		return Exit{}, nil
	case errors.As(err, &exit):
		e := Exit{Code: exit.ExitStatus(), Signal: exit.Signal()}
		if e.Signal != "" && e.Code == 0 {
			e.Code = 128 + signalNumber(e.Signal)
		}
		return e, nil
	case errors.As(err, &missing):
		return Exit{}, ErrNoExitStatus
	}
	return Exit{}, err
}

// Close ends the session and the connection; the guest kills the command.
func (s *Session) Close() error {
	var err error
	s.closeOnce.Do(func() {
		s.stop()
		if s.sess != nil {
			_ = s.sess.Close()
		}
		err = s.client.Close()
		_ = s.conn.Close()
		for _, f := range s.onClose {
			f()
		}
	})
	return err
}
