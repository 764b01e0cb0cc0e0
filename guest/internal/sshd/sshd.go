// Package sshd is the guest's minimal SSH server: the hypervisor runs commands in
// the guest as root with its per-VM key. Public-key auth for root only, "session"
// channels only (exec or shell, optionally on a pty, with window changes and
// signals), no forwarding.
package sshd

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/crypto/ssh"
	"golang.org/x/sys/unix"
)

// Defaults.
const (
	DefaultShell     = "/bin/sh"
	HandshakeTimeout = 30 * time.Second
	// waitDelay bounds the wait for output pipes that a background process
	// keeps open after the command itself exited.
	waitDelay = 5 * time.Second
)

// BaseEnv is every command's environment; "env" requests add to it.
var BaseEnv = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"}

// Server serves SSH on the listeners passed to Serve.
type Server struct {
	// Shell runs commands as `<Shell> -c <command>` and interactively for "shell".
	Shell string
	// Dir is the commands' working directory ("/" when it does not exist).
	Dir string
	// StartCmd starts a command (nil: cmd.Start); done is called after cmd.Wait.
	// PID 1 passes initsys.StartCmd, so that its zombie reaper keeps off.
	StartCmd func(cmd *exec.Cmd) (done func(), err error)
	// Command, when set, builds a session's command instead of Shell in Dir
	// with BaseEnv: args are the shell's ("-c", command; none for "shell"),
	// env the client's "env" requests. It must use exec.CommandContext with
	// ctx. An OCI boot passes ocirun's, which runs it inside the image.
	Command func(ctx context.Context, args, env []string) (*exec.Cmd, error)

	cfg      *ssh.ServerConfig
	keysPath string
	log      func(format string, args ...any)

	mu        sync.Mutex
	closed    bool
	listeners map[net.Listener]struct{}
	conns     map[net.Conn]struct{}
}

// New returns a server that authenticates root against authorizedKeysPath, read
// again on each attempt: the keys arrive from the IMDS after the server started.
func New(hostKey ssh.Signer, authorizedKeysPath string, log func(format string, args ...any)) *Server {
	if log == nil {
		log = func(string, ...any) {}
	}
	s := &Server{
		Shell:     DefaultShell,
		Dir:       "/root",
		keysPath:  authorizedKeysPath,
		log:       log,
		listeners: map[net.Listener]struct{}{},
		conns:     map[net.Conn]struct{}{},
	}
	s.cfg = s.config(hostKey)
	return s
}

func (s *Server) config(hostKey ssh.Signer) *ssh.ServerConfig {
	cfg := &ssh.ServerConfig{
		PublicKeyCallback: s.checkKey,
		ServerVersion:     "SSH-2.0-vm-agent",
	}
	cfg.AddHostKey(hostKey)
	return cfg
}

// SetHostKey serves the connections from now on with hostKey (a fork of
// the VM takes a key of its own); open sessions keep theirs.
func (s *Server) SetHostKey(hostKey ssh.Signer) {
	cfg := s.config(hostKey)
	s.mu.Lock()
	s.cfg = cfg
	s.mu.Unlock()
}

// checkKey admits root with a key listed in the authorized_keys file.
func (s *Server) checkKey(meta ssh.ConnMetadata, key ssh.PublicKey) (*ssh.Permissions, error) {
	if meta.User() != "root" {
		return nil, fmt.Errorf("user %q: only root may log in", meta.User())
	}
	ok, err := authorized(s.keysPath, key)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("key %s not authorized", ssh.FingerprintSHA256(key))
	}
	return &ssh.Permissions{Extensions: map[string]string{"fp": ssh.FingerprintSHA256(key)}}, nil
}

// authorized reports whether key is in the authorized_keys file at path.
func authorized(path string, key ssh.PublicKey) (bool, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	want := key.Marshal()
	for rest := b; len(rest) > 0; {
		k, _, opts, r, err := ssh.ParseAuthorizedKey(rest)
		if err != nil {
			break // no more keys: invalid lines are skipped by the parser
		}
		rest = r
		if bytes.Equal(k.Marshal(), want) && !restricted(opts) {
			return true, nil
		}
	}
	return false, nil
}

// restricted is a key whose options would limit it in ways this server does not
// implement (a forced command, a source address, a CA key, no pty): refusing it
// is safer than granting it more than its owner meant. Options about
// forwarding are moot, none is offered.
func restricted(opts []string) bool {
	for _, o := range opts {
		name, _, _ := strings.Cut(strings.ToLower(o), "=")
		switch name {
		case "cert-authority", "command", "from", "expiry-time", "principals", "restrict", "no-pty":
			return true
		}
	}
	return false
}

// Serve accepts connections until ln fails or Close is called (then it returns nil).
func (s *Server) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.listeners[ln] = struct{}{}
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.listeners, ln)
		s.mu.Unlock()
	}()

	var backoff time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			if s.isClosed() {
				return nil
			}
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			// E.g. out of file descriptors: wait instead of spinning.
			backoff = min(max(2*backoff, 10*time.Millisecond), time.Second)
			s.log("accept: %v; retrying in %s", err, backoff)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		if !s.track(c) {
			c.Close()
			return nil
		}
		go s.serveConn(c)
	}
}

// Close stops all listeners and drops all connections, which kills their commands.
func (s *Server) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	var first error
	for ln := range s.listeners {
		if err := ln.Close(); err != nil && first == nil {
			first = err
		}
	}
	for c := range s.conns {
		c.Close()
	}
	return first
}

func (s *Server) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

func (s *Server) track(c net.Conn) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.conns[c] = struct{}{}
	return true
}

func (s *Server) untrack(c net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.conns, c)
}

func (s *Server) serveConn(c net.Conn) {
	defer s.untrack(c)
	defer c.Close()
	// A client that stalls the handshake must not hold the connection forever.
	_ = c.SetDeadline(time.Now().Add(HandshakeTimeout))
	s.mu.Lock()
	cfg := s.cfg
	s.mu.Unlock()
	conn, chans, reqs, err := ssh.NewServerConn(c, cfg)
	if err != nil {
		s.log("%s: handshake: %v", c.RemoteAddr(), err)
		return
	}
	_ = c.SetDeadline(time.Time{})
	s.log("%s: %s logged in with %s", c.RemoteAddr(), conn.User(), conn.Permissions.Extensions["fp"])
	go ssh.DiscardRequests(reqs)
	var wg sync.WaitGroup
	for nc := range chans {
		if nc.ChannelType() != "session" {
			_ = nc.Reject(ssh.UnknownChannelType, "only session channels")
			continue
		}
		ch, creqs, err := nc.Accept()
		if err != nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.session(ch, creqs)
		}()
	}
	// chans closes when the connection ends; the sessions then kill their commands.
	wg.Wait()
}

// session serves one session channel: env and pty-req requests, then one
// exec or shell; while that runs, window-change and signal requests.
func (s *Server) session(ch ssh.Channel, reqs <-chan *ssh.Request) {
	// reqs closes when the client closes the channel or disconnects: the
	// command is killed then.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	defer ch.Close()
	var (
		env []string
		pty *ptyReq
		p   *proc // the command, once started
	)
	for req := range reqs {
		ok := false
		switch req.Type {
		case "env":
			var kv struct{ Name, Value string }
			if p == nil && ssh.Unmarshal(req.Payload, &kv) == nil && validEnvName(kv.Name) {
				env = append(env, kv.Name+"="+kv.Value)
				ok = true
			}
		case "pty-req":
			if p == nil && pty == nil {
				pty, ok = parsePtyReq(req.Payload)
			}
		case "window-change":
			var wc winChange
			if p != nil && ssh.Unmarshal(req.Payload, &wc) == nil {
				ok = p.resize(wc.Rows, wc.Cols)
			}
		case "signal":
			var sp struct{ Signal string }
			if p != nil && ssh.Unmarshal(req.Payload, &sp) == nil {
				if sig, valid := signalNum(sp.Signal); valid {
					ok = p.signal(sig)
				}
			}
		case "exec", "shell":
			if p != nil {
				break
			}
			var args []string
			if req.Type == "exec" {
				var c struct{ Command string }
				if ssh.Unmarshal(req.Payload, &c) != nil {
					break
				}
				args = []string{"-c", c.Command}
			}
			var err error
			if p, err = s.start(ctx, ch, args, env, pty); err != nil {
				s.log("%s: %v", req.Type, err)
				break
			}
			ok = true
			// Output may overtake this reply, as with OpenSSH's sshd: clients
			// keep the two apart.
			if req.WantReply {
				_ = req.Reply(true, nil)
			}
			continue
		}
		// Anything else (x11-req, agent forwarding, subsystems): refused.
		if req.WantReply {
			_ = req.Reply(ok, nil)
		}
	}
}

// proc is a session's running command.
type proc struct {
	cmd    *exec.Cmd
	exited chan struct{} // closed once the command was reaped
	// mu keeps a window change's ioctl on master apart from its Close once
	// the command ended (os.File's Fd is not safe beside Close).
	mu     sync.Mutex
	master *os.File // the pty's master side, nil without a pty or once closed
}

// resize sets the pty's window size; false without a pty or once it closed.
func (p *proc) resize(rows, cols uint32) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.master != nil && setSize(p.master, rows, cols) == nil
}

// closeMaster closes the pty's master side, once.
func (p *proc) closeMaster() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.master != nil {
		p.master.Close()
		p.master = nil
	}
}

// signal sends sig to the command's process group (what it started too), not
// after it was reaped: its pid may be someone else's by then.
func (p *proc) signal(sig unix.Signal) bool {
	select {
	case <-p.exited:
		return false
	default:
	}
	return unix.Kill(-p.cmd.Process.Pid, sig) == nil
}

func validEnvName(n string) bool {
	return n != "" && !strings.ContainsAny(n, "=\x00")
}

// start runs the shell with args in its own process group (its own session
// with the pty as controlling terminal, when asked for one), so that a kill
// ends everything it started.
func (s *Server) start(ctx context.Context, ch ssh.Channel, args, env []string, pty *ptyReq) (*proc, error) {
	cmd, err := s.command(ctx, args, env)
	if err != nil {
		return nil, err
	}
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.Cancel = func() error { return unix.Kill(-cmd.Process.Pid, unix.SIGKILL) }
	startCmd := s.StartCmd
	if startCmd == nil {
		startCmd = func(cmd *exec.Cmd) (func(), error) { return func() {}, cmd.Start() }
	}
	p := &proc{cmd: cmd, exited: make(chan struct{})}
	if pty != nil {
		return p, s.startPTY(p, ch, pty, startCmd)
	}
	cmd.Stdout = ch
	cmd.Stderr = ch.Stderr()
	cmd.SysProcAttr.Setpgid = true
	cmd.WaitDelay = waitDelay
	// Not cmd.Stdin = ch: Wait would then also wait for the client's EOF.
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	done, err := startCmd(cmd)
	if err != nil {
		stdin.Close()
		return nil, err
	}
	go func() {
		_, _ = io.Copy(stdin, ch)
		stdin.Close() // EOF from the client
	}()
	go func() {
		err := cmd.Wait()
		done()
		close(p.exited)
		s.exit(cmd, err, ch)
	}()
	return p, nil
}

// startPTY runs the command on a new pty. Its output (stdout and stderr
// alike, as with any terminal) is copied until the pty has no other holder;
// the client's EOF means nothing to a terminal (it sends ^D instead).
func (s *Server) startPTY(p *proc, ch ssh.Channel, req *ptyReq, startCmd func(*exec.Cmd) (func(), error)) error {
	master, peer, err := openPTY()
	if err != nil {
		return err
	}
	defer peer.Close() // the child has its own copies
	if err := setSize(master, req.Rows, req.Cols); err != nil {
		master.Close()
		return err
	}
	cmd := p.cmd
	if req.Term != "" {
		cmd.Env = append(cmd.Env, "TERM="+req.Term)
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = peer, peer, peer
	cmd.SysProcAttr.Setsid, cmd.SysProcAttr.Setctty, cmd.SysProcAttr.Ctty = true, true, 0
	done, err := startCmd(cmd)
	if err != nil {
		master.Close()
		return err
	}
	p.master = master
	go func() { _, _ = io.Copy(master, ch) }()
	outDone := make(chan struct{})
	go func() {
		_, _ = io.Copy(ch, master) // ends with EIO once no process holds the pty
		close(outDone)
	}()
	go func() {
		err := cmd.Wait()
		done()
		close(p.exited)
		// A background process that keeps the pty open must not hold the
		// exit status back for ever.
		select {
		case <-outDone:
		case <-time.After(waitDelay):
		}
		p.closeMaster()
		<-outDone
		s.exit(cmd, err, ch)
	}()
	return nil
}

// exit sends the reaped command's exit-status (or exit-signal), then closes
// the channel.
func (s *Server) exit(cmd *exec.Cmd, err error, ch ssh.Channel) {
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) && !errors.Is(err, exec.ErrWaitDelay) {
		s.log("command: %v", err)
	}
	_ = ch.CloseWrite()
	if cmd.ProcessState == nil { // wait(2) itself failed
		_ = ch.Close()
		return
	}
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		sig := strings.TrimPrefix(unix.SignalName(ws.Signal()), "SIG")
		if sig == "" {
			sig = fmt.Sprintf("%d", int(ws.Signal()))
		}
		_, _ = ch.SendRequest("exit-signal", false, ssh.Marshal(struct {
			Signal     string
			CoreDumped bool
			Error      string
			Lang       string
		}{Signal: sig, CoreDumped: ws.CoreDump()}))
	} else {
		var status [4]byte
		binary.BigEndian.PutUint32(status[:], uint32(cmd.ProcessState.ExitCode()))
		_, _ = ch.SendRequest("exit-status", false, status[:])
	}
	_ = ch.Close()
}
