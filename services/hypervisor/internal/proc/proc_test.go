package proc

import (
	"errors"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/pkg/poll"
	"golang.org/x/sys/unix"
)

func TestStartOwnSessionAndExitCode(t *testing.T) {
	p, err := Start(exec.Command("sh", "-c", "exit 3"))
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("no exit")
	}
	if code, known := p.ExitCode(); !known || code != 3 {
		t.Errorf("exit code %d known=%v, want 3", code, known)
	}
	if err := p.Signal(syscall.SIGTERM); !errors.Is(err, ErrGone) {
		t.Errorf("signal after exit: %v", err)
	}
}

func TestSetsid(t *testing.T) {
	p, err := Start(exec.Command("sleep", "30"))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Terminate(time.Second)
	sid, err := unix.Getsid(p.PID)
	if err != nil || sid != p.PID {
		t.Errorf("session %d (%v), want its own (%d)", sid, err, p.PID)
	}
}

func TestAdoptWatchesExitAndRejectsReusedPID(t *testing.T) {
	cmd := exec.Command("sleep", "30")
	p, err := Start(cmd)
	if err != nil {
		t.Fatal(err)
	}
	a, err := Adopt(p.Handle)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Adopt(Handle{PID: p.PID, StartTicks: p.StartTicks + 1}); !errors.Is(err, ErrGone) {
		t.Errorf("adopt with a wrong start time: %v, want ErrGone", err)
	}
	if a.Exited() {
		t.Fatal("adopted process reported exited while running")
	}
	a.Terminate(2 * time.Second)
	select {
	case <-a.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("adopted process exit not observed")
	}
	if _, known := a.ExitCode(); known {
		t.Error("an adopted process's exit code cannot be known")
	}
	<-p.Done()
	if _, err := Adopt(p.Handle); !errors.Is(err, ErrGone) {
		t.Errorf("adopt of an exited process: %v", err)
	}
}

func TestTerminateEscalatesToKill(t *testing.T) {
	p, err := Start(exec.Command("sh", "-c", "trap '' TERM; sleep 30"))
	if err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the shell to ignore TERM", func() bool { return ignores(t, p.PID, syscall.SIGTERM) })
	start := time.Now()
	p.Terminate(300 * time.Millisecond)
	if !p.Exited() {
		t.Fatal("still running after Terminate")
	}
	if code, _ := p.ExitCode(); code != -1 {
		t.Errorf("exit code %d, want -1 (killed)", code)
	}
	if time.Since(start) < 300*time.Millisecond {
		t.Error("SIGKILL came before the grace period")
	}
}

// ignores: process pid ignores sig (a shell's empty trap for it is set).
func ignores(t *testing.T, pid int, sig syscall.Signal) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if hex, ok := strings.CutPrefix(line, "SigIgn:"); ok {
			mask, err := strconv.ParseUint(strings.TrimSpace(hex), 16, 64)
			if err != nil {
				t.Fatalf("%s: %v", line, err)
			}
			return mask&(1<<(sig-1)) != 0
		}
	}
	t.Fatalf("no SigIgn in /proc/%d/status", pid)
	return false
}

func TestStartOfAQuickProcess(t *testing.T) {
	// A process may exit before its start time is read: still ours to reap.
	for i := 0; i < 20; i++ {
		p, err := Start(exec.Command("true"))
		if err != nil {
			t.Fatalf("start %d: %v", i, err)
		}
		<-p.Done()
	}
}

func TestReadStat(t *testing.T) {
	p, err := Start(exec.Command("sleep", "30"))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Terminate(time.Second)
	// Right after fork the child may not have exec'd and mapped anything yet.
	var st Stat
	poll.Until(t, "a resident set", func() bool {
		if st, err = ReadStat(p.PID); err != nil {
			t.Fatal(err)
		}
		return st.RSSBytes != 0
	})
	if st.RSSBytes <= 0 {
		t.Errorf("stat %+v", st)
	}
}

func TestScan(t *testing.T) {
	marker := "vmm-scan-test-" + t.Name()
	// The shell's builtin read: no child process shares its argv (a
	// "sleep 30; true" forks one that carries it until the exec).
	cmd := exec.Command("sh", "-c", "read line", marker)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	defer stdin.Close()
	p, err := Start(cmd)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Terminate(time.Second)
	// Until the child has exec'd, its cmdline is the test binary's: wait
	// (bounded) for the exec, not a fixed time.
	var found []Running
	for deadline := time.Now().Add(10 * time.Second); len(found) == 0 && time.Now().Before(deadline); {
		if found, err = Scan(func(argv []string) bool { return slices.Contains(argv, marker) }); err != nil {
			t.Fatal(err)
		}
		if len(found) == 0 {
			time.Sleep(10 * time.Millisecond)
		}
	}
	if len(found) != 1 || found[0].Handle != p.Handle || found[0].Argv[0] != "sh" {
		t.Fatalf("Scan found %+v, want pid %d", found, p.PID)
	}
	p.Terminate(time.Second)
	if found, _ := Scan(func(argv []string) bool { return slices.Contains(argv, marker) }); len(found) != 0 {
		t.Errorf("an exited process is still found: %+v", found)
	}
}
