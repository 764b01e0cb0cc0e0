package sshd

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/giantswarm/vm-manager/guest/internal/initsys"
	"github.com/giantswarm/vm-manager/pkg/poll"
)

type fixture struct {
	srv      *Server
	addr     string
	keysPath string
	hostKey  ssh.PublicKey
	logMu    sync.Mutex
	logs     []string
}

func newSigner(t *testing.T) ssh.Signer {
	t.Helper()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	s, err := ssh.NewSignerFromKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// start serves on loopback with the host's /bin/sh; keys are authorized_keys lines.
func start(t *testing.T, keys ...ssh.PublicKey) *fixture {
	t.Helper()
	return startWith(t, nil, keys...)
}

// startWith lets setup change the server before it serves.
func startWith(t *testing.T, setup func(*Server), keys ...ssh.PublicKey) *fixture {
	t.Helper()
	fx := &fixture{keysPath: filepath.Join(t.TempDir(), "authorized_keys")}
	fx.authorize(t, keys...)
	host := newSigner(t)
	fx.hostKey = host.PublicKey()
	fx.srv = New(host, fx.keysPath, func(f string, a ...any) {
		fx.logMu.Lock()
		defer fx.logMu.Unlock()
		fx.logs = append(fx.logs, fmt.Sprintf(f, a...))
	})
	fx.srv.Dir = t.TempDir()
	if setup != nil {
		setup(fx.srv)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fx.addr = ln.Addr().String()
	done := make(chan error, 1)
	go func() { done <- fx.srv.Serve(ln) }()
	t.Cleanup(func() {
		fx.srv.Close()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("Serve: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Error("Serve did not return after Close")
		}
	})
	return fx
}

func (fx *fixture) authorize(t *testing.T, keys ...ssh.PublicKey) {
	t.Helper()
	var b bytes.Buffer
	b.WriteString("# comment\n\nnot a key line\n")
	for _, k := range keys {
		b.Write(ssh.MarshalAuthorizedKey(k))
	}
	if err := os.WriteFile(fx.keysPath, b.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
}

// waitLog waits for a log line containing want: the server logs after the client
// has its answer.
func (fx *fixture) waitLog(t *testing.T, want string) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		fx.logMu.Lock()
		logs := strings.Join(fx.logs, "\n")
		fx.logMu.Unlock()
		if strings.Contains(logs, want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("log lacks %q:\n%s", want, logs)
		}
	}
}

func (fx *fixture) dial(user string, key ssh.Signer) (*ssh.Client, error) {
	return ssh.Dial("tcp", fx.addr, &ssh.ClientConfig{
		User:            user,
		Auth:            []ssh.AuthMethod{ssh.PublicKeys(key)},
		HostKeyCallback: ssh.FixedHostKey(fx.hostKey),
		Timeout:         5 * time.Second,
	})
}

func (fx *fixture) mustDial(t *testing.T, key ssh.Signer) *ssh.Client {
	t.Helper()
	c, err := fx.dial("root", key)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// run execs cmd and returns stdout, stderr and the error of Run.
func run(t *testing.T, c *ssh.Client, cmd string, stdin string) (string, string, error) {
	t.Helper()
	sess, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	var out, errOut bytes.Buffer
	sess.Stdout, sess.Stderr = &out, &errOut
	if stdin != "" {
		sess.Stdin = strings.NewReader(stdin)
	}
	err = sess.Run(cmd)
	return out.String(), errOut.String(), err
}

func TestExec(t *testing.T) {
	key := newSigner(t)
	fx := start(t, key.PublicKey())
	c := fx.mustDial(t, key)

	out, errOut, err := run(t, c, `echo out; echo err >&2; exit 3`, "")
	var ee *ssh.ExitError
	if !errors.As(err, &ee) || ee.ExitStatus() != 3 {
		t.Fatalf("err %v, want exit status 3", err)
	}
	if out != "out\n" || errOut != "err\n" {
		t.Errorf("stdout %q stderr %q", out, errOut)
	}

	// The host's command strings: every word single-quoted.
	out, _, err = run(t, c, `'printf' '%s:%s' "$HOME" "$PATH"`, "")
	if err != nil || out != "/root:/usr/sbin:/usr/bin:/sbin:/bin" {
		t.Errorf("env %q %v", out, err)
	}
	out, _, err = run(t, c, `'cat'`, "line 1\nline 2\n")
	if err != nil || out != "line 1\nline 2\n" {
		t.Errorf("stdin %q %v", out, err)
	}
}

func TestEnvAndSignal(t *testing.T) {
	key := newSigner(t)
	fx := start(t, key.PublicKey())
	c := fx.mustDial(t, key)

	sess, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	if err := sess.Setenv("GREETING", "hi"); err != nil {
		t.Fatal(err)
	}
	out, err := sess.Output(`echo "$GREETING"`)
	sess.Close()
	if err != nil || string(out) != "hi\n" {
		t.Errorf("env request: %q %v", out, err)
	}

	_, _, err = run(t, c, `kill -TERM $$`, "")
	var ee *ssh.ExitError
	if !errors.As(err, &ee) || ee.Signal() != "TERM" {
		t.Errorf("err %v, want exit-signal TERM", err)
	}
}

// A shell on a pty: the size is the pty-req's, then each window-change's;
// stderr arrives on the terminal; ^C reaches the foreground job; exit ends it.
func TestPty(t *testing.T) {
	if _, err := os.Stat("/dev/ptmx"); err != nil {
		t.Skip("no /dev/ptmx")
	}
	key := newSigner(t)
	fx := start(t, key.PublicKey())
	c := fx.mustDial(t, key)
	sess, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	if err := sess.RequestPty("xterm", 24, 80, nil); err != nil {
		t.Fatal(err)
	}
	stdin, _ := sess.StdinPipe()
	out := &syncBuf{}
	sess.Stdout = out
	if err := sess.Shell(); err != nil {
		t.Fatal(err)
	}
	expect := func(cmd, want string) {
		t.Helper()
		if _, err := stdin.Write([]byte(cmd + "\n")); err != nil {
			t.Fatal(err)
		}
		out.wait(t, want)
	}
	expect("stty size; echo $TERM", "24 80\r\nxterm")
	if err := sess.WindowChange(40, 100); err != nil {
		t.Fatal(err)
	}
	expect("stty size", "40 100")
	expect("echo to-stderr >&2", "to-stderr")
	// $(($$)): the echoed command line does not match pid=[0-9].
	expect("echo pid=$(($$))", "pid=")
	var shell int
	poll.Until(t, "the shell's pid", func() bool {
		m := regexp.MustCompile(`pid=([0-9]+)`).FindStringSubmatch(out.String())
		if m != nil {
			shell, _ = strconv.Atoi(m[1])
		}
		return m != nil
	})
	// ^C flushes the terminal's queues and signals its foreground process
	// group: send it once sleep runs as that group, not while the shell is
	// between its echo and the fork.
	expect("echo sleeping; sleep 100", "sleeping\r\n")
	poll.Until(t, "sleep to be the terminal's foreground job", func() bool { return foregroundChild(shell, "sleep") })
	if _, err := stdin.Write([]byte{3}); err != nil { // ^C
		t.Fatal(err)
	}
	out.wait(t, "^C")
	expect("echo status-$?", "status-130")
	expect("exit 7", "")
	var ee *ssh.ExitError
	if err := sess.Wait(); !errors.As(err, &ee) || ee.ExitStatus() != 7 {
		t.Fatalf("wait: %v, want exit status 7", err)
	}
}

// A signal request reaches the command's process group.
func TestSignalRequest(t *testing.T) {
	key := newSigner(t)
	fx := start(t, key.PublicKey())
	c := fx.mustDial(t, key)
	sess, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	out := &syncBuf{}
	sess.Stdout = out
	if err := sess.Start("echo started; exec sleep 100"); err != nil {
		t.Fatal(err)
	}
	out.wait(t, "started")
	if err := sess.Signal(ssh.SIGTERM); err != nil {
		t.Fatal(err)
	}
	var ee *ssh.ExitError
	if err := sess.Wait(); !errors.As(err, &ee) || ee.Signal() != "TERM" {
		t.Fatalf("wait: %v, want exit-signal TERM", err)
	}
}

type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// wait waits until the output so far contains want.
func (s *syncBuf) wait(t *testing.T, want string) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		s.mu.Lock()
		got := s.b.String()
		s.mu.Unlock()
		if strings.Contains(got, want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("output lacks %q:\n%q", want, got)
		}
	}
}

// "shell" without a pty: commands come on stdin.
func TestShell(t *testing.T) {
	key := newSigner(t)
	fx := start(t, key.PublicKey())
	c := fx.mustDial(t, key)
	sess, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	var out bytes.Buffer
	sess.Stdout = &out
	sess.Stdin = strings.NewReader("echo from-shell\nexit 4\n")
	if err := sess.Shell(); err != nil {
		t.Fatal(err)
	}
	err = sess.Wait()
	var ee *ssh.ExitError
	if !errors.As(err, &ee) || ee.ExitStatus() != 4 || out.String() != "from-shell\n" {
		t.Errorf("shell: %q %v", out.String(), err)
	}
}

func TestAuth(t *testing.T) {
	key, other := newSigner(t), newSigner(t)
	fx := start(t, key.PublicKey())

	if c, err := fx.dial("root", other); err == nil {
		c.Close()
		t.Error("unauthorized key accepted")
	}
	if c, err := fx.dial("admin", key); err == nil {
		c.Close()
		t.Error("non-root user accepted")
	}
	fx.waitLog(t, `user "admin": only root may log in`)
	// Password auth is not offered at all.
	c, err := ssh.Dial("tcp", fx.addr, &ssh.ClientConfig{
		User:            "root",
		Auth:            []ssh.AuthMethod{ssh.Password("")},
		HostKeyCallback: ssh.FixedHostKey(fx.hostKey),
	})
	if err == nil {
		c.Close()
		t.Error("password auth accepted")
	}

	// Keys arrive after the server started: the file is read on each attempt.
	fx.authorize(t, key.PublicKey(), other.PublicKey())
	c = fx.mustDial(t, other)
	if out, _, err := run(t, c, "echo ok", ""); err != nil || out != "ok\n" {
		t.Errorf("added key: %q %v", out, err)
	}

	// A key restricted by options the server does not implement is refused.
	line := `command="true" ` + string(ssh.MarshalAuthorizedKey(key.PublicKey()))
	if err := os.WriteFile(fx.keysPath, []byte(line), 0o600); err != nil {
		t.Fatal(err)
	}
	if c, err := fx.dial("root", key); err == nil {
		c.Close()
		t.Error("key with command= accepted")
	}
	// No file at all: nobody gets in.
	os.Remove(fx.keysPath)
	if c, err := fx.dial("root", key); err == nil {
		c.Close()
		t.Error("accepted without authorized_keys")
	}
}

// A client that goes away kills its command.
func TestDisconnectKills(t *testing.T) {
	key := newSigner(t)
	fx := start(t, key.PublicKey())
	c, err := fx.dial("root", key)
	if err != nil {
		t.Fatal(err)
	}
	pidFile := filepath.Join(t.TempDir(), "pid")
	sess, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	if err := sess.Start("echo $$ > " + pidFile + "; exec sleep 60"); err != nil {
		t.Fatal(err)
	}
	var pid int
	for deadline := time.Now().Add(5 * time.Second); pid == 0; time.Sleep(10 * time.Millisecond) {
		b, _ := os.ReadFile(pidFile)
		if s := strings.TrimSpace(string(b)); s != "" {
			if pid, err = strconv.Atoi(s); err != nil {
				t.Fatal(err)
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("command did not start")
		}
	}
	c.Close()
	for deadline := time.Now().Add(5 * time.Second); alive(pid); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("pid %d still running after the client disconnected", pid)
		}
	}
}

// foregroundChild: a child of ppid runs comm as the foreground process group
// of its controlling terminal.
func foregroundChild(ppid int, comm string) bool {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid pgrp session tty_nr tpgid ...
		head, rest, ok := strings.Cut(string(b), ") ")
		f := strings.Fields(rest)
		if !ok || len(f) < 6 || !strings.HasSuffix(head, "("+comm) {
			continue
		}
		if f[1] == strconv.Itoa(ppid) && f[2] == f[5] {
			return true
		}
	}
	return false
}

// alive: the process exists and is not a zombie waiting for its parent.
func alive(pid int) bool {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return false
	}
	_, rest, _ := strings.Cut(string(b), ") ")
	return !strings.HasPrefix(rest, "Z")
}

// As PID 1 runs it: the zombie reaper must not take the exit statuses.
func TestWithReaper(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go initsys.ReapZombies(ctx)
	key := newSigner(t)
	fx := startWith(t, func(s *Server) { s.StartCmd = initsys.StartCmd }, key.PublicKey())
	c := fx.mustDial(t, key)
	for i := range 20 {
		_, _, err := run(t, c, `(sleep 0 &); exit 9`, "")
		var ee *ssh.ExitError
		if !errors.As(err, &ee) || ee.ExitStatus() != 9 {
			t.Fatalf("run %d: %v, want exit status 9", i, err)
		}
	}
}
