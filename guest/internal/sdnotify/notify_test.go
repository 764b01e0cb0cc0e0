package sdnotify

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestMessage(t *testing.T) {
	m, err := Message("STATUS=booting up", "READY=1")
	if err != nil || m != "STATUS=booting up\nREADY=1" {
		t.Fatalf("%q %v", m, err)
	}
	for _, bad := range [][]string{nil, {"READY"}, {"=1"}, {"STATUS=a\nb"}, {"STATUS=a\x00"}} {
		if _, err := Message(bad...); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestFrameRoundTrip(t *testing.T) {
	msgs := []string{"STATUS=modules loaded", "READY=1\nSTATUS=ready", ""}
	var stream bytes.Buffer
	for _, m := range msgs {
		b, err := Frame(m)
		if err != nil {
			t.Fatal(err)
		}
		if len(b) != len(m)+1 || b[len(b)-1] != 0 || bytes.IndexByte(b[:len(m)], 0) >= 0 {
			t.Fatalf("frame %q", b)
		}
		stream.Write(b)
	}
	stream.WriteString("STATUS=unfinish") // no terminator: dropped at EOF
	sc := bufio.NewScanner(&stream)
	sc.Split(ScanFrames)
	var got []string
	for sc.Scan() {
		got = append(got, sc.Text())
	}
	if sc.Err() != nil || len(got) != len(msgs) {
		t.Fatalf("got %q, err %v", got, sc.Err())
	}
	for i := range msgs {
		if got[i] != msgs[i] {
			t.Errorf("message %d: %q, want %q", i, got[i], msgs[i])
		}
	}
	if _, err := Frame("a\x00b"); err == nil {
		t.Error("NUL inside a message accepted")
	}
}

func TestSerialWritesFrames(t *testing.T) {
	path := filepath.Join(t.TempDir(), "vport1p1")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := OpenSerial(path)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []string{"STATUS=x", "READY=1"} {
		if err := s.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	s.Close()
	b, _ := os.ReadFile(path)
	if string(b) != "STATUS=x\x00READY=1\x00" {
		t.Fatalf("stream %q", b)
	}
}

func TestParseAddress(t *testing.T) {
	a, err := ParseAddress("vsock-stream:2:1234")
	if err != nil || a != (Address{2, 1234}) || a.String() != "vsock-stream:2:1234" {
		t.Fatalf("%v %v", a, err)
	}
	if a, err := ParseAddress("vsock:2:9"); err != nil || a.Port != 9 {
		t.Fatalf("%v %v", a, err)
	}
	for _, bad := range []string{"", "vsock-dgram:2:1", "vsock-stream:2", "vsock-stream:x:1", "vsock-stream:2:99999999999", "unix:/x"} {
		if _, err := ParseAddress(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

// The vsock sender is exercised over a unix socket: never dial CID 2 in tests.
func TestVsockOneConnectionPerMessage(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "n.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	got := make(chan string, 4)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			b, _ := io.ReadAll(c) // EOF marks the end of one message
			c.Close()
			got <- string(b)
		}
	}()
	var dialed []Address
	v := &Vsock{Addr: Address{CID: 2, Port: 77}, Dial: func(ctx context.Context, a Address) (net.Conn, error) {
		dialed = append(dialed, a)
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}
	for _, m := range []string{"STATUS=one", "READY=1"} {
		if err := v.Send(m); err != nil {
			t.Fatal(err)
		}
		select {
		case g := <-got:
			if g != m {
				t.Fatalf("got %q, want %q", g, m)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("no message")
		}
	}
	if len(dialed) != 2 || dialed[1] != (Address{2, 77}) {
		t.Fatalf("dialed %v", dialed)
	}
}

func TestFindPortAndSelect(t *testing.T) {
	root := t.TempDir()
	p := Paths{SysClass: filepath.Join(root, "sys"), Dev: filepath.Join(root, "dev")}
	ctx := context.Background()
	if _, err := FindPort(p, PortName); !errors.Is(err, ErrNoPort) {
		t.Fatalf("no sysfs dir: %v", err)
	}
	for dir, name := range map[string]string{"vport1p0": "org.qemu.guest_agent.0\n", "vport1p1": PortName + "\n"} {
		os.MkdirAll(filepath.Join(p.SysClass, dir), 0o755)
		os.WriteFile(filepath.Join(p.SysClass, dir, "name"), []byte(name), 0o644)
		os.WriteFile(filepath.Join(p.SysClass, dir, "dev"), []byte("252:1\n"), 0o644)
	}
	os.MkdirAll(p.Dev, 0o755)
	os.WriteFile(filepath.Join(p.Dev, "vport1p1"), nil, 0o600) // as devtmpfs would have made it
	dev, err := FindPort(p, PortName)
	if err != nil || dev != filepath.Join(p.Dev, "vport1p1") {
		t.Fatalf("%q %v", dev, err)
	}
	s, err := Select(ctx, p, time.Second, "vsock-stream:2:5")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, ok := s.(*Serial); !ok {
		t.Fatalf("port present but chose %s", s)
	}

	empty := Paths{SysClass: filepath.Join(root, "none"), Dev: p.Dev}
	s, err = Select(ctx, empty, 20*time.Millisecond, "vsock-stream:2:5")
	if err != nil || s.String() != "vsock-stream:2:5" {
		t.Fatalf("%v %v", s, err)
	}
	if _, err := Select(ctx, empty, 20*time.Millisecond, ""); !errors.Is(err, ErrNoTransport) {
		t.Fatalf("no transport: %v", err)
	}
}

func TestParseDevNumber(t *testing.T) {
	ma, mi, err := ParseDevNumber("252:17\n")
	if err != nil || ma != 252 || mi != 17 {
		t.Fatal(ma, mi, err)
	}
	for _, bad := range []string{"", "252", "a:1", "1:b"} {
		if _, _, err := ParseDevNumber(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
