package consolelog

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/logtail"
)

func lines(from, to int) string {
	var b strings.Builder
	for i := from; i < to; i++ {
		fmt.Fprintf(&b, "line %06d\r\n", i) // 13 bytes
	}
	return b.String()
}

func TestRotateKeepsTheTail(t *testing.T) {
	p := t.TempDir() + "/console.log"
	if r, err := Rotate(p, 1000); err != nil || r.Rotated {
		t.Fatalf("missing file: %+v %v", r, err)
	}
	if err := os.WriteFile(p, []byte(lines(0, 38)), 0o600); err != nil { // 494 bytes
		t.Fatal(err)
	}
	if r, err := Rotate(p, 1000); err != nil || r.Rotated {
		t.Fatalf("under half the cap: %+v %v", r, err)
	}
	// An appending writer, as QEMU with append=on.
	w, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	w.WriteString(lines(38, 100)) // 1300 bytes in all
	r, err := Rotate(p, 1000)
	if err != nil || !r.Rotated || r.Moved != 1300 {
		t.Fatalf("over half the cap: %+v %v", r, err)
	}
	prev, _ := os.ReadFile(logtail.Predecessor(p))
	// The last 500 bytes start within line 61; the tail starts at line 62.
	if string(prev) != lines(62, 100) || r.Kept != int64(len(prev)) || r.Dropped != 1300-r.Kept {
		t.Errorf("kept %d bytes from %q…, result %+v", len(prev), prev[:min(13, len(prev))], r)
	}
	if fi, _ := os.Stat(p); fi.Size() != 0 {
		t.Errorf("console.log is %d bytes after the rotation", fi.Size())
	}
	// The writer goes on at the start of the emptied file.
	w.WriteString(lines(100, 102))
	if b, _ := os.ReadFile(p); string(b) != lines(100, 102) {
		t.Errorf("after the rotation the file holds %q", b)
	}
	if got, want := logtail.Lines(p, 3), "line 000099\nline 000100\nline 000101"; got != want {
		t.Errorf("tail across both files: %q, want %q", got, want)
	}
	// The next rotation replaces the .1 file: what it held is dropped.
	w.WriteString(lines(102, 150))
	r, err = Rotate(p, 1000)
	if err != nil || !r.Rotated || r.Dropped != int64(len(prev))+(r.Moved-r.Kept) {
		t.Errorf("second rotation: %+v %v", r, err)
	}
	if Size(p) > 1000 {
		t.Errorf("both files hold %d bytes, the cap is 1000", Size(p))
	}
}

// A single line longer than the tail is kept as it is (cut), not dropped.
func TestRotateWithoutNewlines(t *testing.T) {
	p := t.TempDir() + "/console.log"
	if err := os.WriteFile(p, bytes.Repeat([]byte("x"), 5000), 0o600); err != nil {
		t.Fatal(err)
	}
	r, err := Rotate(p, 1000)
	if err != nil || r.Kept != 500 || r.Dropped != 4500 {
		t.Fatalf("%+v %v", r, err)
	}
}

func TestAppendOnly(t *testing.T) {
	p := t.TempDir() + "/console.log"
	if err := os.WriteFile(p, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	hold := func(redirect string) *exec.Cmd {
		cmd := exec.Command("/bin/sh", "-c", "exec sleep 30 "+redirect+" '"+p+"'")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		return cmd
	}
	none := hold("")
	appending := hold(">>")
	truncating := hold(">")
	for _, c := range []struct {
		cmd  *exec.Cmd
		want bool
	}{{none, true}, {appending, true}, {truncating, false}} {
		// The shell opens the file before it execs: wait for the descriptor.
		var got bool
		var err error
		for range 100 {
			if got, err = AppendOnly(c.cmd.Process.Pid, p); err == nil && got == c.want {
				break
			}
			exec.Command("sleep", "0.02").Run()
		}
		if err != nil || got != c.want {
			t.Errorf("pid %d (%v): AppendOnly %v, %v; want %v", c.cmd.Process.Pid, c.cmd.Args, got, err, c.want)
		}
	}
}
