package network

import (
	"github.com/giantswarm/vm-manager/pkg/poll"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"
)

var imdsAddr = netip.AddrPortFrom(IMDSAddr, imdsPort)

// imdsGet sends one request on a new connection and returns the status line.
func (g *fakeGuest) imdsGet() (string, error) {
	c, err := g.dialTCP(imdsAddr, 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.WriteString(c, "GET /x HTTP/1.1\r\nHost: 169.254.169.254\r\nConnection: close\r\n\r\n"); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	line, _, _ := strings.Cut(string(b), "\r\n")
	return line, err
}

// closedWithin reports whether the IMDS closes c (EOF or reset) within d.
func closedWithin(c net.Conn, d time.Duration) bool {
	_ = c.SetReadDeadline(time.Now().Add(d))
	_, err := c.Read(make([]byte, 1))
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		return false
	}
	return err != nil
}

// One VM's IMDS connections are bounded (the next is closed at once and
// counted); connections that send no request are closed by the read timeout
// and counted; another VM is served throughout.
func TestIMDSConnectionBounds(t *testing.T) {
	n, err := Start(t.Context(), Spec{Name: "imds", CIDR: "10.84.0.0/24"}, nil, &recorder{name: "A"},
		Limits{IMDSConnsPerVM: 3, IMDSReadTimeout: 2 * time.Second, IMDSIdleTimeout: time.Second}, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Close() })
	a, _ := guestOn(t, n, "a")
	b, _ := guestOn(t, n, "b")

	var held []net.Conn
	for range 3 {
		c, err := a.dialTCP(imdsAddr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		held = append(held, c)
	}
	poll.Until(t, "3 open", func() bool { return n.VMStats("a").IMDSConnections == 3 })
	over, err := a.dialTCP(imdsAddr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer over.Close()
	if !closedWithin(over, time.Second) {
		t.Fatal("the connection over the bound stayed open")
	}
	if st := n.VMStats("a"); st.IMDSRefused != 1 || st.IMDSConnections != 3 {
		t.Fatalf("a: %+v", st)
	}
	if line, err := b.imdsGet(); line != "HTTP/1.1 200 OK" {
		t.Fatalf("b's request while a is at its bound: %q %v", line, err)
	}

	// The held connections sent nothing: the read timeout (2 s) ends them.
	start := time.Now()
	for _, c := range held {
		if !closedWithin(c, 5*time.Second) {
			t.Fatal("a connection without a request outlived the read timeout")
		}
	}
	if d := time.Since(start); d > 4*time.Second {
		t.Errorf("closed after %v", d)
	}
	poll.Until(t, "timeouts counted", func() bool { return n.VMStats("a").IMDSTimedOut == 3 && n.VMStats("a").IMDSConnections == 0 })
	if line, err := a.imdsGet(); line != "HTTP/1.1 200 OK" {
		t.Fatalf("a's request after the timeouts: %q %v", line, err)
	}

	// A kept-alive connection is closed by the idle timeout, not counted.
	c, err := a.dialTCP(imdsAddr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, _ = io.WriteString(c, "GET /x HTTP/1.1\r\nHost: 169.254.169.254\r\n\r\n")
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if k, err := c.Read(make([]byte, 4096)); err != nil || k == 0 {
		t.Fatalf("keep-alive response: %v", err)
	}
	if !closedWithin(c, 5*time.Second) {
		t.Fatal("an idle kept-alive connection stayed open")
	}
	if got := n.VMStats("a").IMDSTimedOut; got != 3 {
		t.Fatalf("idle close counted as a timeout: %d", got)
	}
}

// A slow request (headers trickling in) is cut by the read timeout.
func TestIMDSSlowRequest(t *testing.T) {
	n, err := Start(t.Context(), Spec{Name: "slow", CIDR: "10.85.0.0/24"}, nil, &recorder{name: "A"},
		Limits{IMDSReadTimeout: time.Second}, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.Close() })
	a, _ := guestOn(t, n, "a")
	c, err := a.dialTCP(imdsAddr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	deadline := time.Now().Add(5 * time.Second)
	closed := false
	for _, ch := range "GET /x HTTP/1.1\r\nHost: 169.254.169.254\r\n" {
		if _, err := io.WriteString(c, string(ch)); err != nil {
			closed = true
			break
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	if !closed && !closedWithin(c, 3*time.Second) {
		t.Fatal("a trickling request was not cut")
	}
	poll.Until(t, "timeout counted", func() bool { return n.VMStats("a").IMDSTimedOut == 1 })
}
