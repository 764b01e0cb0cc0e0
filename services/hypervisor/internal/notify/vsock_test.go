package notify

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/pkg/poll"
	"github.com/mdlayher/vsock"
)

// fakeListener hands out the server ends of net.Pipe connections that report
// a vsock peer address. No real vsock is used (these hosts have none for
// QEMU, and tests must never dial CID 2).
type fakeListener struct {
	conns  chan net.Conn
	closed chan struct{}
	once   sync.Once
}

func newFakeListener() *fakeListener {
	return &fakeListener{conns: make(chan net.Conn), closed: make(chan struct{})}
}

func (l *fakeListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	}
}

func (l *fakeListener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return nil
}

type peerConn struct {
	net.Conn
	remote net.Addr
}

func (c peerConn) RemoteAddr() net.Addr { return c.remote }

// dial returns the guest end of a new connection from cid:port.
func (l *fakeListener) dial(t *testing.T, cid, port uint32) net.Conn {
	t.Helper()
	guest, host := net.Pipe()
	select {
	case l.conns <- peerConn{host, &vsock.Addr{ContextID: cid, Port: port}}:
	case <-time.After(5 * time.Second):
		t.Fatal("listener does not accept")
	}
	return guest
}

// send writes one message the way the guest does: connect, write, close.
func (l *fakeListener) send(t *testing.T, cid, port uint32, msg string) {
	t.Helper()
	c := l.dial(t, cid, port)
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatalf("write: %v", err)
	}
	c.Close()
}

func serve(t *testing.T, r *Router, l Listener) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- r.ServeVsock(ctx, l) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-errc:
			case <-time.After(5 * time.Second):
				t.Error("ServeVsock did not return after ctx ended")
			}
		})
		return err
	}
	t.Cleanup(func() { stop() })
	return stop
}

func waitStats(t *testing.T, r *Router, ok func(Stats) bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !ok(r.Stats()) {
		if time.Now().After(deadline) {
			t.Fatalf("stats %+v", r.Stats())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestServeVsockRoutesByCID(t *testing.T) {
	r := NewRouter()
	r.MapCID(3, "vm-a")
	r.MapCID(4, "vm-b")
	a, ca := r.Subscribe("vm-a")
	defer ca()
	b, cb := r.Subscribe("vm-b")
	defer cb()
	l := newFakeListener()
	serve(t, r, l)

	l.send(t, 3, 1023, "READY=1\nSTATUS=ready")
	m := recv(t, a)
	if !m.Ready || m.Status != "ready" || !m.Privileged {
		t.Errorf("vm-a got %+v, want ready and privileged (port 1023)", m)
	}
	l.send(t, 4, 1024, "STATUS=from user space")
	if m := recv(t, b); m.Status != "from user space" || m.Privileged {
		t.Errorf("vm-b got %+v, want unprivileged (port 1024)", m)
	}
	waitStats(t, r, func(s Stats) bool { return s.Delivered == 2 }) // vm-b's Deliver is over
	noMessage(t, a)

	// Unknown and unmapped CIDs are not routed.
	l.send(t, 99, 1, "READY=1")
	r.UnmapCID(4)
	l.send(t, 4, 1, "READY=1")
	waitStats(t, r, func(s Stats) bool { return s.Unrouted == 2 })
	noMessage(t, b)

	l.send(t, 3, 1, "not sd_notify")
	waitStats(t, r, func(s Stats) bool { return s.Malformed == 1 })
}

func TestServeVsockOversize(t *testing.T) {
	r := NewRouter()
	r.MapCID(3, "vm")
	ch, cancel := r.Subscribe("vm")
	defer cancel()
	l := newFakeListener()
	serve(t, r, l)

	c := l.dial(t, 3, 1)
	// The host stops reading after MaxMessage+1 bytes and closes: the write fails.
	_, _ = c.Write([]byte("STATUS=" + strings.Repeat("x", MaxMessage)))
	c.Close()
	waitStats(t, r, func(s Stats) bool { return s.Oversize == 1 })
	// The next message still arrives.
	l.send(t, 3, 1, "READY=1")
	if m := recv(t, ch); !m.Ready {
		t.Errorf("got %+v", m)
	}
}

func TestServeVsockReadDeadline(t *testing.T) {
	r := NewRouter()
	r.vsockReadTimeout = 200 * time.Millisecond
	r.MapCID(3, "vm")
	ch, cancel := r.Subscribe("vm")
	defer cancel()
	l := newFakeListener()
	serve(t, r, l)

	// A guest that writes but never closes: the message is incomplete.
	c := l.dial(t, 3, 1)
	defer c.Close()
	go c.Write([]byte("READY=1"))
	// The host closes its end after the deadline (EOF here; a timeout of
	// this read would mean it kept the connection), and only after it
	// decided not to deliver.
	c.SetReadDeadline(time.Now().Add(poll.Bound))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("host kept the connection past its read deadline: %v", err)
	}
	noMessage(t, ch)
}

func TestServeVsockLimitsConnectionsPerCID(t *testing.T) {
	r := NewRouter()
	r.vsockPerCID = 2
	r.MapCID(3, "vm")
	r.MapCID(5, "other")
	ch, cancel := r.Subscribe("other")
	defer cancel()
	l := newFakeListener()
	serve(t, r, l)

	// Two idle connections from CID 3 use up its share.
	idle1, idle2 := l.dial(t, 3, 1), l.dial(t, 3, 1)
	defer idle1.Close()
	defer idle2.Close()
	third := l.dial(t, 3, 1)
	if _, err := third.Write([]byte("READY=1")); err == nil {
		t.Error("third connection from one CID was served")
	}
	waitStats(t, r, func(s Stats) bool { return s.Refused == 1 })
	// Another guest is not affected.
	l.send(t, 5, 1, "READY=1")
	if m := recv(t, ch); !m.Ready {
		t.Errorf("got %+v", m)
	}
	// A closed connection frees its slot.
	idle1.Close()
	poll.Until(t, "the closed connection's slot freed", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.open[3] < r.vsockPerCID
	})
	r.MapCID(3, "other")
	l.send(t, 3, 1, "STATUS=slot free")
	if m := recv(t, ch); m.Status != "slot free" {
		t.Errorf("got %+v", m)
	}
}

func TestServeVsockStops(t *testing.T) {
	r := NewRouter()
	r.MapCID(3, "vm")
	l := newFakeListener()
	stop := serve(t, r, l)
	open := l.dial(t, 3, 1) // in flight: must not keep ServeVsock alive
	defer open.Close()
	if err := stop(); err != nil {
		t.Errorf("ServeVsock after ctx end: %v", err)
	}
	select {
	case <-l.closed:
	default:
		t.Error("listener not closed")
	}
}

type failingListener struct{ err error }

func (l failingListener) Accept() (net.Conn, error) { return nil, l.err }
func (l failingListener) Close() error              { return nil }

func TestServeVsockReturnsAcceptError(t *testing.T) {
	boom := errors.New("boom")
	if err := NewRouter().ServeVsock(context.Background(), failingListener{boom}); !errors.Is(err, boom) {
		t.Errorf("err %v, want boom", err)
	}
}

func TestServeVsockRefusesNonVsockPeer(t *testing.T) {
	r := NewRouter()
	l := newFakeListener()
	serve(t, r, l)
	guest, host := net.Pipe()
	l.conns <- host // RemoteAddr is a pipe address, not *vsock.Addr
	if _, err := guest.Write([]byte("READY=1")); err == nil {
		t.Error("served a connection without a vsock peer")
	}
	waitStats(t, r, func(s Stats) bool { return s.Refused == 1 })
}

// TestListenVsock binds a real AF_VSOCK listener where the kernel has one;
// it never connects anywhere.
func TestListenVsock(t *testing.T) {
	l, port, err := ListenVsock(0)
	if err != nil {
		t.Skipf("no AF_VSOCK here: %v", err)
	}
	defer l.Close()
	if port == 0 || port == 0xFFFFFFFF {
		t.Errorf("port %d, want the one the kernel picked", port)
	}
	if _, _, err := ListenVsock(port); !errors.Is(err, ErrPortInUse) {
		t.Errorf("second listen on port %d: %v, want ErrPortInUse", port, err)
	}
}
