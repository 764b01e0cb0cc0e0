package notify

import (
	"bytes"
	"context"
	"maps"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   string
		want Message
		err  bool
	}{
		{"ready", "READY=1", Message{Ready: true, Fields: map[string]string{"READY": "1"}}, false},
		{"ready and status", "READY=1\nSTATUS=up and running\n", Message{Ready: true, Status: "up and running", Fields: map[string]string{"READY": "1", "STATUS": "up and running"}}, false},
		{"ready 0", "READY=0", Message{Fields: map[string]string{"READY": "0"}}, false},
		{"empty lines", "\n\nSTATUS=x\n\n", Message{Status: "x", Fields: map[string]string{"STATUS": "x"}}, false},
		{"value with =", "X_KEY=a=b", Message{Fields: map[string]string{"X_KEY": "a=b"}}, false},
		{"empty value", "STATUS=", Message{Fields: map[string]string{"STATUS": ""}}, false},
		{"repeated key", "STATUS=a\nSTATUS=b", Message{Status: "b", Fields: map[string]string{"STATUS": "b"}}, false},
		{"empty", "", Message{Fields: map[string]string{}}, false},
		{"no =", "READY=1\nGARBAGE", Message{}, true},
		{"empty key", "=1", Message{}, true},
		{"too long", "X=" + strings.Repeat("a", MaxMessage-1), Message{}, true},
		{"max", "X=" + strings.Repeat("a", MaxMessage-2), Message{Fields: map[string]string{"X": strings.Repeat("a", MaxMessage-2)}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Parse([]byte(tc.in))
			if (err != nil) != tc.err {
				t.Fatalf("err %v, want error %v", err, tc.err)
			}
			if tc.err {
				return
			}
			if got.Ready != tc.want.Ready || got.Status != tc.want.Status || !maps.Equal(got.Fields, tc.want.Fields) || got.Privileged {
				t.Errorf("got %+v, want %+v", got, tc.want)
			}
		})
	}
}

// collect feeds chunks to a framer and returns the messages and oversize count.
func collect(chunks ...string) ([]string, int) {
	var f framer
	var msgs []string
	over := 0
	for _, c := range chunks {
		f.feed([]byte(c), func(b []byte) { msgs = append(msgs, string(b)) }, func() { over++ })
	}
	return msgs, over
}

func TestFramer(t *testing.T) {
	big := strings.Repeat("x", MaxMessage+1)
	for _, tc := range []struct {
		name   string
		chunks []string
		want   []string
		over   int
	}{
		{"one", []string{"READY=1\x00"}, []string{"READY=1"}, 0},
		{"several in one read", []string{"A=1\x00B=2\x00C=3\x00"}, []string{"A=1", "B=2", "C=3"}, 0},
		{"split across reads", []string{"REA", "DY=", "1\x00STA", "TUS=x\x00"}, []string{"READY=1", "STATUS=x"}, 0},
		{"NUL alone", []string{"A=1", "\x00"}, []string{"A=1"}, 0},
		{"unterminated tail held", []string{"A=1\x00B=2"}, []string{"A=1"}, 0},
		{"empty messages", []string{"\x00\x00A=1\x00"}, []string{"", "", "A=1"}, 0},
		{"exactly max", []string{strings.Repeat("y", MaxMessage) + "\x00"}, []string{strings.Repeat("y", MaxMessage)}, 0},
		{"oversize dropped, next kept", []string{big + "\x00READY=1\x00"}, []string{"READY=1"}, 1},
		{"oversize across reads", []string{big[:40000], big[40000:], "tail\x00READY=1\x00"}, []string{"READY=1"}, 1},
		{"oversize then split next", []string{big, "\x00REA", "DY=1\x00"}, []string{"READY=1"}, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, over := collect(tc.chunks...)
			if strings.Join(got, "|") != strings.Join(tc.want, "|") || len(got) != len(tc.want) || over != tc.over {
				t.Errorf("got %d msgs %.80q oversize %d; want %.80q oversize %d", len(got), got, over, tc.want, tc.over)
			}
		})
	}
}

func recv(t *testing.T, ch <-chan Message) Message {
	t.Helper()
	select {
	case m, ok := <-ch:
		if !ok {
			t.Fatal("subscription closed")
		}
		return m
	case <-time.After(5 * time.Second):
		t.Fatal("no message")
	}
	return Message{}
}

// noMessage checks that nothing is queued for ch. Deliver queues without
// blocking, so call it once an event shows that a message would be there
// by now: Deliver returned, a counter moved, a later message arrived.
func noMessage(t *testing.T, ch <-chan Message) {
	t.Helper()
	select {
	case m := <-ch:
		t.Fatalf("unexpected message %+v", m)
	default:
	}
}

func TestSubscribeUnsubscribe(t *testing.T) {
	r := NewRouter()
	ch, cancel := r.Subscribe("vm1")
	other, cancelOther := r.Subscribe("vm2")
	defer cancelOther()

	r.Deliver(Delivery{VM: "vm1", Msg: Message{Ready: true}})
	if m := recv(t, ch); !m.Ready {
		t.Errorf("got %+v", m)
	}
	noMessage(t, other)

	cancel()
	cancel() // idempotent
	if _, ok := <-ch; ok {
		t.Error("channel open after unsubscribe")
	}
	r.Deliver(Delivery{VM: "vm1", Msg: Message{Ready: true}})
	if s := r.Stats(); s.Unrouted != 1 || s.Delivered != 1 {
		t.Errorf("stats %+v", s)
	}

	// Two subscribers of one VM both get the message.
	a, ca := r.Subscribe("vm3")
	b, cb := r.Subscribe("vm3")
	defer ca()
	defer cb()
	r.Deliver(Delivery{VM: "vm3", Msg: Message{Status: "s"}})
	if recv(t, a).Status != "s" || recv(t, b).Status != "s" {
		t.Error("fan-out")
	}
}

func TestOverflowCountedPerVM(t *testing.T) {
	r := NewRouter()
	ch, cancel := r.Subscribe("vm1")
	defer cancel()
	_, cancel2 := r.Subscribe("vm2")
	defer cancel2()
	for i := 0; i < SubscriberBuffer+5; i++ {
		r.Deliver(Delivery{VM: "vm1", Msg: Message{Status: string(rune('a' + i))}})
	}
	if got := r.Dropped("vm1"); got != 5 {
		t.Errorf("vm1 dropped %d, want 5", got)
	}
	if got := r.Dropped("vm2"); got != 0 {
		t.Errorf("vm2 dropped %d", got)
	}
	if got := r.Stats().Dropped; got != 5 {
		t.Errorf("total dropped %d", got)
	}
	// The oldest are kept: the first message is still the first.
	if m := recv(t, ch); m.Status != "a" {
		t.Errorf("first kept message %q", m.Status)
	}
	r.Forget("vm1")
	if got := r.Dropped("vm1"); got != 0 {
		t.Errorf("dropped after Forget: %d", got)
	}
}

// shortSocket returns a unix socket path under the 107-byte limit.
func shortSocket(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "vmm-notify-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return filepath.Join(dir, "notify.sock")
}

// TestAttachSerialRedials plays QEMU: it serves the socket, writes, closes
// the connection and the socket, then serves it again.
func TestAttachSerialRedials(t *testing.T) {
	sock := shortSocket(t)
	r := NewRouter()
	ch, cancel := r.Subscribe("vm1")
	defer cancel()

	ctx, stop := context.WithCancel(context.Background())
	attached := make(chan struct{})
	go func() {
		defer close(attached)
		r.AttachSerial(ctx, "vm1", sock)
	}()

	time.Sleep(100 * time.Millisecond) // AttachSerial is already retrying: QEMU "starts" late
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	c, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	// Two messages, one split over two writes, then a partial message that
	// dies with the connection. The first message arriving shows that the
	// first write was read (whole, as a unix socket hands it over): the
	// second write is another read.
	c.Write([]byte("STATUS=booting\x00REA"))
	if m := recv(t, ch); m.Status != "booting" || !m.Privileged {
		t.Errorf("first message %+v", m)
	}
	c.Write([]byte("DY=1\x00STATUS=lost"))
	if m := recv(t, ch); !m.Ready {
		t.Errorf("second message %+v", m)
	}
	c.Close()
	l.Close() // QEMU gone: the socket file is removed

	time.Sleep(200 * time.Millisecond)
	l, err = net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err = l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	c.Write([]byte("STATUS=again\x00"))
	if m := recv(t, ch); m.Status != "again" {
		t.Errorf("message after redial %+v", m)
	}

	// Malformed messages are counted, not routed.
	c.Write([]byte("no equals sign\x00READY=1\x00"))
	if m := recv(t, ch); !m.Ready {
		t.Errorf("after malformed %+v", m)
	}
	if s := r.Stats(); s.Malformed != 1 {
		t.Errorf("stats %+v", s)
	}

	stop()
	select {
	case <-attached:
	case <-time.After(5 * time.Second):
		t.Fatal("AttachSerial did not return after ctx ended")
	}
	// The connection was closed by AttachSerial.
	c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Error("connection still open")
	}
	c.Close()
}

func TestAttachSerialOversize(t *testing.T) {
	sock := shortSocket(t)
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	r := NewRouter()
	ch, cancel := r.Subscribe("vm1")
	defer cancel()
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	go r.AttachSerial(ctx, "vm1", sock)
	c, err := l.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var b bytes.Buffer
	b.WriteString("STATUS=")
	b.WriteString(strings.Repeat("z", 3*MaxMessage))
	b.WriteString("\x00READY=1\x00")
	if _, err := c.Write(b.Bytes()); err != nil {
		t.Fatal(err)
	}
	if m := recv(t, ch); !m.Ready || m.Status != "" {
		t.Errorf("message after the oversize one %+v", m)
	}
	if s := r.Stats(); s.Oversize != 1 {
		t.Errorf("stats %+v", s)
	}
}

func TestAttachSerialReturnsWhileDialling(t *testing.T) {
	r := NewRouter()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	sock := shortSocket(t)
	done := make(chan struct{})
	go func() {
		r.AttachSerial(ctx, "vm1", sock)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("AttachSerial ignores ctx while the socket is missing")
	}
}
