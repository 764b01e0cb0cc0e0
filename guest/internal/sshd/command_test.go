package sshd

import (
	"context"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// Command replaces the shell, its environment and directory (an OCI
// boot's sessions run in the image); the server keeps what the hook set in
// SysProcAttr and adds its process group or session.
func TestCommandHook(t *testing.T) {
	dir := t.TempDir()
	var mu sync.Mutex
	var seen [][]string
	key := newSigner(t)
	fx := startWith(t, func(s *Server) {
		s.Command = func(ctx context.Context, args, env []string) (*exec.Cmd, error) {
			mu.Lock()
			seen = append(seen, append(append([]string(nil), args...), env...))
			mu.Unlock()
			cmd := exec.CommandContext(ctx, "/bin/sh", args...)
			cmd.Env = append([]string{"ONLY=hook"}, env...)
			cmd.Dir = dir
			cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
			return cmd, nil
		}
	}, key.PublicKey())
	c := fx.mustDial(t, key)
	sess, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	sess.Setenv("X", "1")
	out, err := sess.Output(`echo "$ONLY $X $HOME $(pwd)"`)
	sess.Close()
	if err != nil || string(out) != "hook 1  "+dir+"\n" {
		t.Errorf("exec through the hook: %q %v", out, err)
	}
	mu.Lock()
	if len(seen) != 1 || !slices.Equal(seen[0], []string{"-c", `echo "$ONLY $X $HOME $(pwd)"`, "X=1"}) {
		t.Errorf("hook saw %q", seen)
	}
	mu.Unlock()
	if _, err := os.Stat("/dev/ptmx"); err != nil {
		return
	}
	sess, err = c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	if err := sess.RequestPty("xterm", 24, 80, nil); err != nil {
		t.Fatal(err)
	}
	b, err := sess.Output(`echo "pty $ONLY $TERM"; tty >/dev/null && echo has-tty`)
	if err != nil || !strings.Contains(string(b), "pty hook xterm") || !strings.Contains(string(b), "has-tty") {
		t.Errorf("pty through the hook: %q %v", b, err)
	}
}
