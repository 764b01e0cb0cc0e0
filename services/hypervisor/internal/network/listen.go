package network

import (
	"errors"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// limitListener bounds each VM's open connections to a service inside the
// network (the IMDS, the DNS over TCP), by the connection's peer address: the
// attach filter guarantees it is the VM's lease. A connection over the bound
// is closed at once and counted.
type limitListener struct {
	net.Listener
	n       *Network
	max     int
	conns   func(*vmState) *atomic.Int32
	refused func(*vmState)
	// timedOut, if set, is counted when a read times out while a request is
	// being read (see limitedConn.Read).
	timedOut func(*vmState)
}

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		var peer netip.Addr
		if ap, err := netip.ParseAddrPort(c.RemoteAddr().String()); err == nil {
			peer = ap.Addr().Unmap()
		}
		vs := l.n.vmAt(peer)
		if vs == nil {
			return c, nil // no VM: the service refuses it itself
		}
		open := l.conns(vs)
		if int(open.Add(1)) > l.max {
			open.Add(-1)
			l.refused(vs)
			l.n.log.Debug("connection over the VM's bound closed", "vm", vs.id, "service", l.Addr().String(), "max", l.max)
			_ = c.Close()
			continue
		}
		return &limitedConn{Conn: c, vs: vs, open: open, timedOut: l.timedOut}, nil
	}
}

// limitedConn gives its place back when closed.
type limitedConn struct {
	net.Conn
	vs       *vmState
	open     *atomic.Int32
	once     sync.Once
	timedOut func(*vmState)

	state    atomic.Int32 // http.ConnState, from the server's ConnState hook
	deadline atomic.Int64 // the last read deadline, unix nanoseconds
}

func (c *limitedConn) Close() error {
	c.once.Do(func() { c.open.Add(-1) })
	return c.Conn.Close()
}

// CloseWrite lets net/http half-close as it does on a plain TCP connection.
func (c *limitedConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// longAgo is before any deadline but net/http's way of interrupting its own
// background read (a deadline in 1970).
var longAgo = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC).UnixNano()

func (c *limitedConn) SetReadDeadline(t time.Time) error {
	c.deadline.Store(t.UnixNano())
	return c.Conn.SetReadDeadline(t)
}

func (c *limitedConn) SetDeadline(t time.Time) error {
	c.deadline.Store(t.UnixNano())
	return c.Conn.SetDeadline(t)
}

// Read counts a timeout while a request is being read (a new connection or
// an active one; not an idle keep-alive connection, whose end is normal).
func (c *limitedConn) Read(b []byte) (int, error) {
	k, err := c.Conn.Read(b)
	var ne net.Error
	if err != nil && c.timedOut != nil && errors.As(err, &ne) && ne.Timeout() &&
		c.deadline.Load() > longAgo && http.ConnState(c.state.Load()) != http.StateIdle {
		c.timedOut(c.vs)
	}
	return k, err
}

// trackState is an http.Server ConnState hook for limitedConns.
func trackState(c net.Conn, s http.ConnState) {
	if lc, ok := c.(*limitedConn); ok {
		lc.state.Store(int32(s))
	}
}

// serveIMDS serves h at 169.254.169.254:80 inside the network: each VM's
// connections bounded, requests read within the read timeout, kept-alive
// connections closed after the idle timeout.
func (n *Network) serveIMDS(h http.Handler) error {
	ln, err := n.us.listenTCP(netip.AddrPortFrom(IMDSAddr, imdsPort))
	if err != nil {
		return err
	}
	n.imdsSrv = &http.Server{
		Handler:           h,
		ReadHeaderTimeout: min(imdsHeaderTimeout, n.limits.IMDSReadTimeout),
		ReadTimeout:       n.limits.IMDSReadTimeout,
		IdleTimeout:       n.limits.IMDSIdleTimeout,
		ConnState:         trackState,
	}
	lim := &limitListener{Listener: ln, n: n, max: n.limits.IMDSConnsPerVM,
		conns:    func(v *vmState) *atomic.Int32 { return &v.imdsConns },
		refused:  func(v *vmState) { v.imdsRefused.Add(1) },
		timedOut: func(v *vmState) { v.imdsTimedOut.Add(1) }}
	n.wg.Go(func() {
		if err := n.imdsSrv.Serve(lim); err != nil && !errors.Is(err, http.ErrServerClosed) {
			n.log.Warn("IMDS server stopped", "err", err)
		}
	})
	return nil
}
