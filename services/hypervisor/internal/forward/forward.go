// Package forward proxies a loopback TCP port on the host to a guest port
// through a network's userspace stack (contract §7.4), with half-close.
package forward

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"sync"
	"time"
)

// DialFunc connects to the guest (the network's DialContextTCP).
type DialFunc func(ctx context.Context) (net.Conn, error)

// DialTimeout bounds one connection attempt into the guest.
const DialTimeout = 10 * time.Second

// Forward is one listening port.
type Forward struct {
	ln   net.Listener
	dial DialFunc
	log  *slog.Logger

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
}

// Listen binds addr ("127.0.0.1:0" for a new port, or the port a restored
// forward had) and proxies every connection to dial until Close.
func Listen(addr string, dial DialFunc, log *slog.Logger) (*Forward, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &Forward{ln: ln, dial: dial, log: log, ctx: ctx, cancel: cancel, conns: map[net.Conn]struct{}{}}
	f.wg.Add(1)
	go f.accept()
	return f, nil
}

// Addr is the host address, 127.0.0.1:<port>.
func (f *Forward) Addr() string { return f.ln.Addr().String() }

func (f *Forward) accept() {
	defer f.wg.Done()
	for {
		c, err := f.ln.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				f.log.Warn("port forward accept failed", "addr", f.Addr(), "err", err)
			}
			return
		}
		if !f.track(c, true) {
			_ = c.Close()
			return
		}
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			defer f.track(c, false)
			f.proxy(c)
		}()
	}
}

func (f *Forward) track(c net.Conn, add bool) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !add {
		delete(f.conns, c)
		return true
	}
	if f.ctx.Err() != nil {
		return false
	}
	f.conns[c] = struct{}{}
	return true
}

func (f *Forward) proxy(host net.Conn) {
	defer host.Close()
	ctx, cancel := context.WithTimeout(f.ctx, DialTimeout)
	guest, err := f.dial(ctx)
	cancel()
	if err != nil {
		f.log.Debug("port forward could not reach the guest", "addr", f.Addr(), "err", err)
		return
	}
	defer guest.Close()
	stop := context.AfterFunc(f.ctx, func() { _ = guest.Close(); _ = host.Close() })
	defer stop()
	var wg sync.WaitGroup
	wg.Go(func() { pipe(guest, host) })
	pipe(host, guest)
	wg.Wait()
}

type closeWriter interface{ CloseWrite() error }

// pipe copies src to dst, then half-closes dst so the peer sees EOF while
// the other direction keeps flowing.
func pipe(dst, src net.Conn) {
	_, _ = io.Copy(dst, src)
	if cw, ok := dst.(closeWriter); ok {
		_ = cw.CloseWrite()
	} else {
		_ = dst.Close()
	}
}

// Close stops listening and ends the open connections.
func (f *Forward) Close() error {
	f.mu.Lock()
	f.cancel()
	conns := make([]net.Conn, 0, len(f.conns))
	for c := range f.conns {
		conns = append(conns, c)
	}
	f.mu.Unlock()
	err := f.ln.Close()
	for _, c := range conns {
		_ = c.Close()
	}
	f.wg.Wait()
	return err
}
