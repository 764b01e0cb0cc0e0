package forward

import (
	"context"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"
)

// echoUpper answers each connection with its input upper-cased, after the
// client half-closed: it proves both directions and the half-close.
func echoUpper(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				b, _ := io.ReadAll(c)
				c.Write([]byte(strings.ToUpper(string(b))))
			}()
		}
	}()
	return ln
}

func TestForwardHalfClose(t *testing.T) {
	target := echoUpper(t)
	f, err := Listen("127.0.0.1:0", func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", target.Addr().String())
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if !strings.HasPrefix(f.Addr(), "127.0.0.1:") {
		t.Fatalf("Addr = %s", f.Addr())
	}
	for range 3 {
		c, err := net.Dial("tcp", f.Addr())
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte("hello"))
		c.(*net.TCPConn).CloseWrite()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		b, err := io.ReadAll(c)
		c.Close()
		if err != nil || string(b) != "HELLO" {
			t.Fatalf("got %q, %v", b, err)
		}
	}
}

func TestForwardCloseEndsConnections(t *testing.T) {
	target, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer target.Close()
	go func() {
		for {
			c, err := target.Accept()
			if err != nil {
				return
			}
			defer c.Close()      // holds the connection open
			c.Write([]byte("+")) // the client reading it sees the proxy connected
		}
	}()
	f, err := Listen("127.0.0.1:0", func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", target.Addr().String())
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	addr := f.Addr()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if b, err := io.ReadAll(io.LimitReader(c, 1)); err != nil || string(b) != "+" {
		t.Fatalf("the target's greeting through the proxy: %q %v", b, err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	// EOF or a reset: a timeout would be the connection still open.
	if _, err := c.Read(make([]byte, 1)); err == nil || os.IsTimeout(err) {
		t.Fatalf("connection still open after Close: %v", err)
	}
	if _, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		t.Fatal("port still listening after Close")
	}
	// The port can be bound again: how a restored forward keeps its address.
	again, err := Listen(addr, func(context.Context) (net.Conn, error) { return nil, io.EOF }, nil)
	if err != nil {
		t.Fatalf("re-bind %s: %v", addr, err)
	}
	again.Close()
}

func TestForwardGuestUnreachable(t *testing.T) {
	f, err := Listen("127.0.0.1:0", func(context.Context) (net.Conn, error) { return nil, io.ErrUnexpectedEOF }, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	c, err := net.Dial("tcp", f.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("read = %v, want EOF when the guest cannot be reached", err)
	}
}
