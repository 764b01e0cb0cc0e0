package initsys

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"
)

// The reaper takes orphans but leaves StartCmd's children to their cmd.Wait, also
// while both kinds exit at the same time.
func TestReapSparesStartCmd(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go ReapZombies(ctx)

	// A long-running managed child: the reaper scans instead of wait4(-1).
	long := exec.Command("sh", "-c", "read x; exit 5")
	stdin, err := long.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	longDone, err := StartCmd(long)
	if err != nil {
		t.Fatal(err)
	}

	// Not waited for by anyone but the reaper.
	stray := exec.Command("true")
	if err := stray.Start(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); exists(stray.Process.Pid); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("unmanaged child not reaped while a managed one runs")
		}
	}

	for i := range 50 {
		cmd := exec.Command("sh", "-c", "exit 7")
		done, err := StartCmd(cmd)
		if err != nil {
			t.Fatal(err)
		}
		err = cmd.Wait()
		done()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 7 {
			t.Fatalf("run %d: %v, want exit status 7", i, err)
		}
	}

	stdin.Close()
	err = long.Wait()
	longDone()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 5 {
		t.Fatalf("long: %v, want exit status 5", err)
	}
}

func exists(pid int) bool {
	_, err := os.Stat("/proc/" + strconv.Itoa(pid))
	return err == nil
}
