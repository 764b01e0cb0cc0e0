// Package connsplit hands each connection of one TCP listener to either the
// gRPC server's own transport or the HTTP server, by what the connection's
// first request is: gRPC served through http.Server and grpc.Server's
// ServeHTTP costs about a hundred microseconds more per call than grpc.Server
// on the connection itself (docs/performance.md#gateway-hop).
//
// A connection is gRPC when it opens with HTTP/2's prior-knowledge preface and
// its first HEADERS frame has a content-type of application/grpc (grpc-go,
// grpcurl -plaintext); everything else, REST over h2c prior knowledge
// included, goes to the HTTP server, which still serves gRPC requests that
// come later on such a connection. The server's preface, an empty SETTINGS
// frame, is sent at once, as clients such as grpc-go wait for it before
// their first request; their ACK of it is dropped, the server the
// connection goes to did not send that frame. A client that sends no
// request within HeadersWait is taken as gRPC.
package connsplit

import (
	"bufio"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// preface is what an HTTP/2 client with prior knowledge sends first.
const preface = http2.ClientPreface

// PrefaceWait bounds the wait for a connection's first bytes; a connection
// that sends nothing by then goes to the HTTP server, whose own timeouts
// apply from there. A variable for the tests.
var PrefaceWait = 10 * time.Second

// Limits of the look at a connection's start.
const (
	// HeadersWait bounds the wait, after the preface, for the first HEADERS
	// frame (see the package comment).
	HeadersWait = 200 * time.Millisecond
	// maxSniffBytes bounds what is read before deciding: the preface, the
	// client's SETTINGS and WINDOW_UPDATE and one header block fit easily.
	maxSniffBytes = 64 << 10
)

// Split accepts on ln and returns the listeners the gRPC and HTTP servers
// serve on. Closing either of them does not close ln; Close does.
type Split struct {
	ln   net.Listener
	GRPC net.Listener
	HTTP net.Listener

	grpcCh, httpCh chan net.Conn
	done           chan struct{}
	once           sync.Once
	wg             sync.WaitGroup

	mu      sync.Mutex
	pending map[net.Conn]bool // being classified
}

// New starts accepting on ln.
func New(ln net.Listener) *Split {
	s := &Split{ln: ln, grpcCh: make(chan net.Conn), httpCh: make(chan net.Conn), done: make(chan struct{}), pending: map[net.Conn]bool{}}
	s.GRPC = &listener{s: s, ch: s.grpcCh, closed: make(chan struct{})}
	s.HTTP = &listener{s: s, ch: s.httpCh, closed: make(chan struct{})}
	s.wg.Add(1)
	go s.accept()
	return s
}

// Close stops accepting, closes ln and connections not yet handed over.
func (s *Split) Close() error {
	var err error
	s.once.Do(func() {
		close(s.done)
		err = s.ln.Close()
		s.mu.Lock()
		for c := range s.pending { // not to wait for their first bytes
			c.Close()
		}
		s.mu.Unlock()
	})
	s.wg.Wait()
	return err
}

func (s *Split) accept() {
	defer s.wg.Done()
	for {
		c, err := s.ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return
		}
		s.mu.Lock()
		select {
		case <-s.done:
			s.mu.Unlock()
			c.Close()
			return
		default:
		}
		s.pending[c] = true
		s.mu.Unlock()
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			conn, grpc := classify(c)
			s.mu.Lock()
			delete(s.pending, c)
			s.mu.Unlock()
			ch := s.httpCh
			if grpc {
				ch = s.grpcCh
			}
			select {
			case ch <- conn:
			case <-s.done:
				c.Close()
			}
		}()
	}
}

// classify reads the connection's start and returns the connection with
// what was read put back in front, and whether it is gRPC.
func classify(c net.Conn) (net.Conn, bool) {
	rec := &recorder{r: c}
	br := bufio.NewReaderSize(rec, 4096)
	h2, grpc := sniff(c, br)
	_ = c.SetReadDeadline(time.Time{})
	if len(rec.buf) == 0 {
		return c, grpc
	}
	rc := &replayConn{Conn: c, buf: rec.buf}
	if h2 {
		// The client acknowledges our SETTINGS: that ACK is not for the
		// server the connection goes to (net/http's counts them).
		rc.frames = bufio.NewReaderSize(rc.raw(), 4096)
		rc.pass = len(preface)
		rc.look = maxLookFrames
	}
	return rc, grpc
}

// settings is an empty SETTINGS frame: the server's preface, which clients
// such as grpc-go wait for before their first request.
var settings = []byte{0, 0, 0, byte(http2.FrameSettings), 0, 0, 0, 0, 0}

// sniff reports whether the connection opened with HTTP/2's preface (then
// it sent the client an empty SETTINGS frame) and whether it is gRPC.
func sniff(c net.Conn, br *bufio.Reader) (h2, grpc bool) {
	_ = c.SetReadDeadline(time.Now().Add(PrefaceWait))
	// Byte by byte as they come: an HTTP/1 request may be shorter than
	// the preface.
	for n := 1; n <= len(preface); n++ {
		b, err := br.Peek(n)
		if err != nil || b[n-1] != preface[n-1] {
			return false, false
		}
	}
	_, _ = br.Discard(len(preface))
	_ = c.SetWriteDeadline(time.Now().Add(HeadersWait))
	_, err := c.Write(settings)
	_ = c.SetWriteDeadline(time.Time{})
	if err != nil {
		return false, false // a client that does not read: the HTTP server's to refuse
	}
	_ = c.SetReadDeadline(time.Now().Add(HeadersWait))
	fr := http2.NewFramer(io.Discard, io.LimitReader(br, maxSniffBytes))
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	fr.MaxHeaderListSize = maxSniffBytes
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			// No request yet: a client waiting for something else.
			var ne net.Error
			return true, errors.As(err, &ne) && ne.Timeout()
		}
		if h, ok := f.(*http2.MetaHeadersFrame); ok {
			return true, h.PseudoValue("method") == "POST" && isGRPCContentType(h.Fields)
		}
	}
}

func isGRPCContentType(fields []hpack.HeaderField) bool {
	for _, f := range fields {
		if f.Name == "content-type" {
			return f.Value == "application/grpc" || strings.HasPrefix(f.Value, "application/grpc+") || strings.HasPrefix(f.Value, "application/grpc;")
		}
	}
	return false
}

// recorder keeps every byte read from r.
type recorder struct {
	r   io.Reader
	buf []byte
}

func (r *recorder) Read(p []byte) (int, error) {
	n, err := r.r.Read(p)
	r.buf = append(r.buf, p[:n]...)
	return n, err
}

// maxLookFrames bounds the frames searched for the client's SETTINGS ACK,
// which it sends at once.
const maxLookFrames = 64

// replayConn is a connection whose first reads return what classify read.
// On an HTTP/2 connection it drops the client's first SETTINGS ACK (the
// answer to the frame sniff sent), looking at up to look frame headers.
type replayConn struct {
	net.Conn
	buf []byte

	frames *bufio.Reader // the bytes while looking for the ACK
	pass   int           // bytes before the next frame header
	look   int
}

func (c *replayConn) Read(p []byte) (int, error) {
	for c.look > 0 {
		if c.pass > 0 {
			n, err := c.frames.Read(p[:min(len(p), c.pass)])
			c.pass -= n
			return n, err
		}
		h, err := c.frames.Peek(9)
		if err != nil {
			return 0, err
		}
		length := int(h[0])<<16 | int(h[1])<<8 | int(h[2])
		c.look--
		if http2.FrameType(h[3]) == http2.FrameSettings && http2.Flags(h[4]).Has(http2.FlagSettingsAck) {
			_, _ = c.frames.Discard(9 + length)
			c.look = 0
			break
		}
		c.pass = 9 + length
	}
	if c.frames != nil {
		if c.frames.Buffered() > 0 {
			return c.frames.Read(p)
		}
		c.frames = nil
	}
	return c.raw().Read(p)
}

// raw is the connection with the replayed bytes first.
func (c *replayConn) raw() io.Reader { return (*rawReader)(c) }

type rawReader replayConn

func (r *rawReader) Read(p []byte) (int, error) {
	if len(r.buf) == 0 {
		return r.Conn.Read(p)
	}
	n := copy(p, r.buf)
	r.buf = r.buf[n:]
	return n, nil
}

// CloseWrite keeps the half-close net/http uses on TCP connections.
func (c *replayConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// listener hands out the connections classified for one server.
type listener struct {
	s      *Split
	ch     chan net.Conn
	once   sync.Once
	closed chan struct{}
}

func (l *listener) Accept() (net.Conn, error) {
	select {
	case c := <-l.ch:
		return c, nil
	case <-l.closed:
		return nil, net.ErrClosed
	case <-l.s.done:
		return nil, net.ErrClosed
	}
}

func (l *listener) Close() error {
	l.once.Do(func() { close(l.closed) })
	return nil
}

func (l *listener) Addr() net.Addr { return l.s.ln.Addr() }
