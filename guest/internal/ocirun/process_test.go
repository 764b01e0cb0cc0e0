package ocirun

import (
	"context"
	"os/exec"
	"reflect"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/giantswarm/vm-manager/pkg/ociboot"
)

func TestEnv(t *testing.T) {
	for _, c := range []struct {
		image []string
		want  []string
	}{
		{nil, []string{"PATH=" + DefaultPath, "HOME=/root"}},
		{[]string{"PATH=/x", "A=1", "=bad", "noequals", "HOME=/h"}, []string{"PATH=/x", "A=1", "HOME=/h"}},
		{[]string{"EMPTY="}, []string{"EMPTY=", "PATH=" + DefaultPath, "HOME=/root"}},
	} {
		if got := Env(c.image, "/root"); !reflect.DeepEqual(got, c.want) {
			t.Errorf("Env(%q) = %q, want %q", c.image, got, c.want)
		}
	}
	if v := Getenv([]string{"A=1", "B=2", "A=3"}, "A"); v != "3" {
		t.Errorf("Getenv: %q", v)
	}
}

func TestArgv(t *testing.T) {
	for _, c := range []struct {
		cfg  ociboot.Config
		want []string
	}{
		{ociboot.Config{Entrypoint: []string{"/bin/app", "-v"}, Cmd: []string{"serve"}}, []string{"/bin/app", "-v", "serve"}},
		{ociboot.Config{Cmd: []string{"python3", "-m", "http.server"}}, []string{"python3", "-m", "http.server"}},
		{ociboot.Config{Entrypoint: []string{"/bin/app"}}, []string{"/bin/app"}},
	} {
		if got, err := Argv(c.cfg); err != nil || !reflect.DeepEqual(got, c.want) {
			t.Errorf("Argv(%+v) = %q, %v", c.cfg, got, err)
		}
	}
	if _, err := Argv(ociboot.Config{}); err == nil || !strings.Contains(err.Error(), "neither entrypoint nor cmd") {
		t.Errorf("empty config: %v", err)
	}
	if _, err := Argv(ociboot.Config{Cmd: []string{"a\x00b"}}); err == nil {
		t.Error("NUL accepted")
	}
}

func TestIdentityCommand(t *testing.T) {
	id := Identity{Env: []string{"PATH=/bin", "HOME=/h"}, Dir: "/srv", User: User{UID: 5, GID: 6, Groups: []uint32{7}}}
	cmd := id.Command(context.Background(), "/oci/root", "/bin/sh", []string{"sh", "-c", "true"}, []string{"TERM=x"})
	if cmd.Path != "/bin/sh" || !reflect.DeepEqual(cmd.Args, []string{"sh", "-c", "true"}) || cmd.Dir != "/srv" {
		t.Errorf("cmd %q %q in %q", cmd.Path, cmd.Args, cmd.Dir)
	}
	if !reflect.DeepEqual(cmd.Env, []string{"PATH=/bin", "HOME=/h", "TERM=x"}) {
		t.Errorf("env %q", cmd.Env)
	}
	a := cmd.SysProcAttr
	if a.Chroot != "/oci/root" || a.Credential.Uid != 5 || a.Credential.Gid != 6 || !reflect.DeepEqual(a.Credential.Groups, []uint32{7}) {
		t.Errorf("attr %+v %+v", a, a.Credential)
	}
}

func TestCopyLines(t *testing.T) {
	var got []string
	long := strings.Repeat("x", maxLine+10)
	copyLines(strings.NewReader("one\r\ntwo\n\n"+long+"\nlast"), "[p] ", func(l string) { got = append(got, l) })
	want := []string{"[p] one", "[p] two", "[p] ", "[p] " + long[:maxLine], "[p] " + long[maxLine:], "[p] last"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("lines %q", got)
	}
}

// startProc with a real child: output lines, exit status, and what it left
// behind in its session killed.
func TestStartProc(t *testing.T) {
	var mu sync.Mutex
	var lines []string
	cmd := exec.Command("/bin/sh", "-c", "echo out; echo err >&2; sleep 60 & exit 3")
	cmd.SysProcAttr = &syscall.SysProcAttr{}
	p, err := startProc(cmd, plainStart, "[entrypoint] ", func(l string) {
		mu.Lock()
		lines = append(lines, l)
		mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan Exit, 1)
	go func() { done <- p.Wait() }()
	select {
	case ex := <-done:
		if ex.Code != 3 || ex.Signal != 0 || ex.Err != nil {
			t.Errorf("exit %+v", ex)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Wait did not return: the background sleep holds the pipe")
	}
	mu.Lock()
	defer mu.Unlock()
	if !reflect.DeepEqual(lines, []string{"[entrypoint] out", "[entrypoint] err"}) && !reflect.DeepEqual(lines, []string{"[entrypoint] err", "[entrypoint] out"}) {
		t.Errorf("lines %q", lines)
	}
	if p.Signal(unix.SIGTERM) {
		t.Error("signal after Wait delivered")
	}
}

func plainStart(c *exec.Cmd) (func(), error) { return func() {}, c.Start() }
