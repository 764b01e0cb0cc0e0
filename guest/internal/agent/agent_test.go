package agent

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/guest/internal/sdnotify"
)

func TestConsolePrefixesEveryLine(t *testing.T) {
	var b bytes.Buffer
	c := NewConsole(&b)
	c.Printf("hostname %s", "t1")
	c.Printf("fatal: panic\nstack\n")
	want := "vm-agent: hostname t1\nvm-agent: fatal: panic\nvm-agent: stack\n"
	if b.String() != want {
		t.Fatalf("%q", b.String())
	}
	// A workload's line goes out as it is.
	b.Reset()
	c.Line("[entrypoint] hello")
	if b.String() != "[entrypoint] hello\n" {
		t.Fatalf("%q", b.String())
	}
}

// Without vmm.oci.* words the OCI part does nothing, and its methods are
// safe on the nil it returns.
func TestNoOCIRoot(t *testing.T) {
	var b bytes.Buffer
	con := NewConsole(&b)
	var oci *ociBoot
	oci.start(con, nil)
	oci.waitStarted(con)
	oci.stop(con)
	if oci.command() != nil || b.Len() != 0 {
		t.Errorf("command %v, console %q", oci.command() != nil, b.String())
	}
}

type fakeSender struct {
	mu   sync.Mutex
	msgs []string
	done chan struct{}
}

func (f *fakeSender) Send(m string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.msgs = append(f.msgs, m)
	if strings.Contains(m, "READY=1") {
		close(f.done)
	}
	return nil
}
func (f *fakeSender) Close() error   { return nil }
func (f *fakeSender) String() string { return "fake" }

// Messages queued before the transport is known are delivered in order afterwards.
func TestQueueDeliversInOrder(t *testing.T) {
	var out bytes.Buffer
	q := newQueue(NewConsole(&out))
	q.Send("STATUS=loading kernel modules")
	q.Send("STATUS=bad\nvalue") // rejected, not sent
	q.Send("READY=1", "STATUS=ready")
	s := &fakeSender{done: make(chan struct{})}
	go q.run(func() (sdnotify.Sender, error) { return s, nil })
	select {
	case <-s.done:
	case <-time.After(5 * time.Second):
		t.Fatal("READY=1 not delivered")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.msgs) != 2 || s.msgs[0] != "STATUS=loading kernel modules" || s.msgs[1] != "READY=1\nSTATUS=ready" {
		t.Fatalf("%q", s.msgs)
	}
}

func TestQueueWithoutTransport(t *testing.T) {
	var out bytes.Buffer
	con := NewConsole(&out)
	q := newQueue(con)
	q.Send("READY=1")
	go q.run(func() (sdnotify.Sender, error) { return nil, sdnotify.ErrNoTransport })
	deadline := time.Now().Add(5 * time.Second)
	for {
		con.mu.Lock()
		s := out.String()
		con.mu.Unlock()
		if strings.Contains(s, "vm-agent: readiness cannot be reported") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("console: %q", s)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestMachineIDFromCredential(t *testing.T) {
	id, src, err := machineID(map[string][]byte{CredMachineID: []byte("0123456789ABCDEF0123456789ABCDEF\n")})
	if err != nil || id != "0123456789abcdef0123456789abcdef" || src != "credential" {
		t.Fatal(id, src, err)
	}
	if _, _, err := machineID(map[string][]byte{CredMachineID: []byte("nope")}); err == nil {
		t.Fatal("bad id accepted")
	}
}

func TestCmdlineDuration(t *testing.T) {
	p := filepath.Join(t.TempDir(), "cmdline")
	if err := os.WriteFile(p, []byte("console=ttyS0 vm-agent.poweroff-after-ready=1500ms panic=-1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if d, ok := cmdlineDuration(p, "vm-agent.poweroff-after-ready"); !ok || d != 1500*time.Millisecond {
		t.Errorf("got %v %v", d, ok)
	}
	if _, ok := cmdlineDuration(p, "vm-agent.other"); ok {
		t.Error("found an absent key")
	}
}
