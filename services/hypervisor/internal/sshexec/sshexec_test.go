package sshexec

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"golang.org/x/crypto/ssh"
)

// guest is a tiny SSH server at the port under test: it runs exec requests
// with the host's /bin/sh, as the guest's vm-agent does.
type guest struct {
	cfg *ssh.ServerConfig
	ln  net.Listener
}

func newGuest(t *testing.T, authorized ssh.PublicKey) *guest {
	t.Helper()
	_, hk, _ := ed25519.GenerateKey(rand.Reader)
	signer, err := ssh.NewSignerFromKey(hk)
	if err != nil {
		t.Fatal(err)
	}
	cfg := &ssh.ServerConfig{PublicKeyCallback: func(c ssh.ConnMetadata, k ssh.PublicKey) (*ssh.Permissions, error) {
		if c.User() == "root" && bytes.Equal(k.Marshal(), authorized.Marshal()) {
			return nil, nil
		}
		return nil, errors.New("denied")
	}}
	cfg.AddHostKey(signer)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	g := &guest{cfg: cfg, ln: ln}
	go g.serve()
	return g
}

func (g *guest) serve() {
	for {
		c, err := g.ln.Accept()
		if err != nil {
			return
		}
		go func() {
			_, chans, reqs, err := ssh.NewServerConn(c, g.cfg)
			if err != nil {
				return
			}
			go ssh.DiscardRequests(reqs)
			for nc := range chans {
				ch, creqs, _ := nc.Accept()
				go func() {
					for r := range creqs {
						if r.Type != "exec" {
							r.Reply(false, nil)
							continue
						}
						cmdLen := binary.BigEndian.Uint32(r.Payload)
						cmd := exec.Command("/bin/sh", "-c", string(r.Payload[4:4+cmdLen]))
						cmd.Stdout, cmd.Stderr = ch, ch.Stderr()
						r.Reply(true, nil)
						code := 0
						if err := cmd.Run(); err != nil {
							code = cmd.ProcessState.ExitCode()
						}
						ch.SendRequest("exit-status", false, binary.BigEndian.AppendUint32(nil, uint32(code)))
						ch.Close()
					}
				}()
			}
		}()
	}
}

func (g *guest) dial(t *testing.T) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", g.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func key(t *testing.T) ([]byte, ssh.PublicKey) {
	t.Helper()
	priv, line, err := NewKey("vm-manager@test")
	if err != nil {
		t.Fatal(err)
	}
	pub, comment, _, _, err := ssh.ParseAuthorizedKey([]byte(line))
	if err != nil || comment != "vm-manager@test" || pub.Type() != ssh.KeyAlgoED25519 {
		t.Fatalf("authorized key line %q: %v", line, err)
	}
	return priv, pub
}

func TestRunResultAndPin(t *testing.T) {
	priv, pub := key(t)
	g := newGuest(t, pub)
	pin := PinFile(filepath.Join(t.TempDir(), "ssh_host_key"))
	res, err := Run(context.Background(), g.dial(t), priv, pin, []string{"sh", "-c", "echo out; echo it\\'s >&2; exit 3"})
	if err != nil {
		t.Fatal(err)
	}
	if string(res.Stdout) != "out\n" || string(res.Stderr) != "it's\n" || res.ExitCode != 3 {
		t.Fatalf("result = %q %q %d", res.Stdout, res.Stderr, res.ExitCode)
	}
	if b, err := os.ReadFile(string(pin)); err != nil || !strings.HasPrefix(string(b), "ssh-ed25519 ") {
		t.Fatalf("pin file %q: %v", b, err)
	}
	// Same guest again: the pin holds.
	if res, err := Run(context.Background(), g.dial(t), priv, pin, []string{"echo", "a b", "'q'"}); err != nil || string(res.Stdout) != "a b 'q'\n" {
		t.Fatalf("second run: %+v %v", res, err)
	}
	// Another guest (another host key) behind the same pin is refused.
	other := newGuest(t, pub)
	if _, err := Run(context.Background(), other.dial(t), priv, pin, []string{"true"}); !errors.Is(err, ErrHostKeyChanged) {
		t.Fatalf("changed host key: err = %v", err)
	}
}

// TestFirstPinConcurrent: concurrent first execs on a fresh VM all succeed
// (they used to race on one temporary file: "rename …ssh_host_key.tmp: no
// such file or directory"), and of two guests racing to be first one wins.
func TestFirstPinConcurrent(t *testing.T) {
	priv, pub := key(t)
	g := newGuest(t, pub)
	pin := PinFile(filepath.Join(t.TempDir(), "ssh_host_key"))
	var wg sync.WaitGroup
	errs := make([]error, 16)
	for i := range errs {
		conn := g.dial(t)
		wg.Go(func() { _, errs[i] = Run(context.Background(), conn, priv, pin, []string{"true"}) })
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Errorf("exec %d: %v", i, err)
		}
	}
	if left, _ := filepath.Glob(string(pin) + ".tmp*"); len(left) > 0 {
		t.Errorf("temporary files left: %q", left)
	}

	other := newGuest(t, pub)
	for range 4 {
		pin := PinFile(filepath.Join(t.TempDir(), "ssh_host_key"))
		a, b := g.dial(t), other.dial(t)
		var errA, errB error
		wg.Go(func() { _, errA = Run(context.Background(), a, priv, pin, []string{"true"}) })
		wg.Go(func() { _, errB = Run(context.Background(), b, priv, pin, []string{"true"}) })
		wg.Wait()
		if (errA == nil) == (errB == nil) || !errors.Is(errors.Join(errA, errB), ErrHostKeyChanged) {
			t.Fatalf("two guests racing for the pin: %v, %v; want one pinned, the other refused", errA, errB)
		}
	}
}

func TestRunRefusedKey(t *testing.T) {
	priv, _ := key(t)
	_, otherPub := key(t)
	g := newGuest(t, otherPub)
	if _, err := Run(context.Background(), g.dial(t), priv, PinFile(filepath.Join(t.TempDir(), "pin")), []string{"true"}); err == nil || !strings.Contains(err.Error(), "handshake") {
		t.Fatalf("err = %v, want a handshake failure", err)
	}
}

func TestRunCancelled(t *testing.T) {
	priv, pub := key(t)
	g := newGuest(t, pub)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := Run(ctx, g.dial(t), priv, PinFile(filepath.Join(t.TempDir(), "pin")), []string{"sleep", "30"})
		done <- err
	}()
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
}

func TestCappedOutput(t *testing.T) {
	c := &capped{max: 4}
	c.Write([]byte("abc"))
	c.Write([]byte("def"))
	if c.buf.String() != "abcd" || !c.over {
		t.Fatalf("capped = %q over=%v", c.buf.String(), c.over)
	}
}

func TestQuote(t *testing.T) {
	if got := Quote([]string{"cat", "/a b", "it's"}); got != `'cat' '/a b' 'it'\''s'` {
		t.Fatalf("Quote = %s", got)
	}
}
