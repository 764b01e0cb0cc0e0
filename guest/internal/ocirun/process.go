package ocirun

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/giantswarm/vm-manager/pkg/ociboot"
)

// DefaultPath is the PATH of an image whose config sets none (Docker's).
const DefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// maxLine bounds one line of the entrypoint's output on the console;
// longer ones are cut into several.
const maxLine = 4096

// Identity is how the image's processes run: environment, working
// directory and user. The entrypoint and every exec session share it.
type Identity struct {
	Env  []string
	Dir  string
	User User
}

// NewIdentity is cfg's identity, the user resolved in the image at root.
func NewIdentity(root string, cfg ociboot.Config) (Identity, error) {
	passwd, err := readFileIn(root, "/etc/passwd", maxDBBytes)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return Identity{}, err
	}
	group, err := readFileIn(root, "/etc/group", maxDBBytes)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return Identity{}, err
	}
	u, err := ResolveUser(cfg.User, passwd, group)
	if err != nil {
		return Identity{}, err
	}
	dir := cfg.WorkingDir
	if dir == "" {
		dir = "/"
	} else if !strings.HasPrefix(dir, "/") {
		dir = "/" + dir // OCI wants it absolute; Docker reads it from /
	}
	return Identity{Env: Env(cfg.Env, u.Home), Dir: dir, User: u}, nil
}

// Env is the image's environment as a runtime passes it: its entries in
// order (malformed ones, without "=", dropped), PATH when it has none, and
// HOME from the user's passwd entry when it has none.
func Env(image []string, home string) []string {
	var env []string
	has := map[string]bool{}
	for _, kv := range image {
		k, _, ok := strings.Cut(kv, "=")
		if !ok || k == "" || strings.ContainsRune(kv, 0) {
			continue
		}
		has[k] = true
		env = append(env, kv)
	}
	if !has["PATH"] {
		env = append(env, "PATH="+DefaultPath)
	}
	if !has["HOME"] {
		env = append(env, "HOME="+home)
	}
	return env
}

// Argv is what the image runs: entrypoint, then cmd (OCI and Docker
// semantics: cmd are the entrypoint's arguments, or the command itself).
func Argv(cfg ociboot.Config) ([]string, error) {
	argv := append(append([]string(nil), cfg.Entrypoint...), cfg.Cmd...)
	if len(argv) == 0 {
		return nil, errors.New("the image's config has neither entrypoint nor cmd")
	}
	for _, a := range argv {
		if strings.ContainsRune(a, 0) {
			return nil, errors.New("the image's entrypoint or cmd holds a NUL byte")
		}
	}
	return argv, nil
}

// Getenv is key's value in env (the last one, as exec.Cmd keeps).
func Getenv(env []string, key string) string {
	v := ""
	for _, kv := range env {
		if k, val, ok := strings.Cut(kv, "="); ok && k == key {
			v = val
		}
	}
	return v
}

// Command is path (inside root) with argv, run chrooted into root as the
// identity's user, in its directory, with its environment and then extra.
func (id Identity) Command(ctx context.Context, root, path string, argv, extra []string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, path)
	cmd.Args = argv
	cmd.Env = append(append([]string(nil), id.Env...), extra...)
	cmd.Dir = id.Dir // the child's chdir comes after its chroot
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Chroot:     root,
		Credential: &syscall.Credential{Uid: id.User.UID, Gid: id.User.GID, Groups: id.User.Groups},
	}
	return cmd
}

// proc is a started entrypoint: its own session (no terminal), its output
// a pipe read into console lines.
type proc struct {
	cmd    *exec.Cmd
	done   func()        // the reaper's release (StartCmd)
	exited chan struct{} // closed once it was reaped
	output chan struct{} // closed once the pipe reached EOF
}

// startProc starts cmd with stdout and stderr on one pipe, each line of it
// passed to line with prefix.
func startProc(cmd *exec.Cmd, startCmd func(*exec.Cmd) (func(), error), prefix string, line func(string)) (*proc, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = w, w
	cmd.SysProcAttr.Setsid = true
	done, err := startCmd(cmd)
	w.Close() // the child has its copy
	if err != nil {
		r.Close()
		return nil, err
	}
	p := &proc{cmd: cmd, done: done, exited: make(chan struct{}), output: make(chan struct{})}
	go func() {
		defer close(p.output)
		defer r.Close()
		copyLines(r, prefix, line)
	}()
	return p, nil
}

func (p *proc) Pid() int { return p.cmd.Process.Pid }

// Wait reaps it, then kills what it left in its session: a container's
// processes end with its init.
func (p *proc) Wait() Exit {
	err := p.cmd.Wait()
	close(p.exited)
	p.done()
	_ = unix.Kill(-p.cmd.Process.Pid, unix.SIGKILL)
	<-p.output
	var ee *exec.ExitError
	switch {
	case err == nil, errors.As(err, &ee):
		if ws, ok := p.cmd.ProcessState.Sys().(syscall.WaitStatus); ok {
			return exitOf(ws)
		}
		return Exit{Code: p.cmd.ProcessState.ExitCode()}
	}
	return Exit{Err: err}
}

// Signal sends sig to its process group, only while it runs: after Wait
// the group id may be someone else's.
func (p *proc) Signal(sig unix.Signal) bool {
	select {
	case <-p.exited:
		return false
	default:
	}
	return unix.Kill(-p.cmd.Process.Pid, sig) == nil
}

// copyLines passes r's lines to line, each with prefix, carriage returns
// dropped, cut at maxLine bytes.
func copyLines(r io.Reader, prefix string, line func(string)) {
	br := bufio.NewReaderSize(r, maxLine)
	for {
		b, err := br.ReadSlice('\n')
		if len(b) > 0 {
			line(prefix + strings.TrimRight(string(b), "\r\n"))
		}
		switch {
		case err == nil, errors.Is(err, bufio.ErrBufferFull):
			continue
		case errors.Is(err, io.EOF):
			return
		default:
			line(fmt.Sprintf("%s(output lost: %v)", prefix, err))
			return
		}
	}
}
