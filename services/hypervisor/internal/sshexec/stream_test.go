package sshexec

import (
	"bytes"
	"context"
	"crypto/sha256"
	"io"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// A streamed command's output arrives complete and in order even when the
// reader is slower than the command (the channel's window holds the command
// back; nothing is dropped), stderr apart, the exit code last.
func TestOpenStreamsEverything(t *testing.T) {
	priv, pub := key(t)
	g := newGuest(t, pub)
	pin := PinFile(filepath.Join(t.TempDir(), "ssh_host_key"))
	const size = 5 << 20 // more than the window and than Run's cap
	s, err := Open(context.Background(), g.dial(t), priv, pin, StreamOptions{
		Argv: []string{"sh", "-c", "seq 1 1000000 | head -c 5242880; echo done >&2; exit 5"},
	})
	if err != nil {
		t.Fatal(err)
	}
	closed := 0
	s.OnClose(func() { closed++ })
	defer func() {
		s.Close()
		s.Close()
		if closed != 1 {
			t.Errorf("OnClose ran %d times", closed)
		}
	}()
	errc := make(chan []byte, 1)
	go func() {
		b, _ := io.ReadAll(s.Stderr)
		errc <- b
	}()
	time.Sleep(500 * time.Millisecond) // the command fills the window and waits
	var out bytes.Buffer
	if _, err := io.Copy(&out, s.Stdout); err != nil {
		t.Fatal(err)
	}
	stderr := <-errc
	exit, err := s.Wait()
	if err != nil || exit.Code != 5 || string(stderr) != "done\n" {
		t.Fatalf("exit %+v %v, stderr %q", exit, err, stderr)
	}
	var want bytes.Buffer
	for i := 1; want.Len() < size; i++ {
		want.WriteString(strconv.Itoa(i) + "\n")
	}
	if out.Len() != size || sha256.Sum256(out.Bytes()) != sha256.Sum256(want.Bytes()[:size]) {
		t.Fatalf("stdout: %d bytes, want %d, same content: %v", out.Len(), size, bytes.Equal(out.Bytes(), want.Bytes()[:size]))
	}
}
