package notify

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/mdlayher/vsock"
	"golang.org/x/sys/unix"
)

// ErrPortInUse means the requested notify port is taken.
var ErrPortInUse = errors.New("notify port in use")

// Listener accepts guest connections. Their RemoteAddr must be a *vsock.Addr.
type Listener interface {
	Accept() (net.Conn, error)
	Close() error
}

// ListenVsock listens on port (0: the kernel picks one) for every CID, and
// returns the port actually bound.
func ListenVsock(port uint32) (Listener, uint32, error) {
	l, err := vsock.ListenContextID(unix.VMADDR_CID_ANY, port, nil)
	if err != nil {
		if errors.Is(err, unix.EADDRINUSE) {
			return nil, 0, fmt.Errorf("%w: vsock port %d: %v", ErrPortInUse, port, err)
		}
		return nil, 0, fmt.Errorf("vsock listen on port %d: %w", port, err)
	}
	addr, ok := l.Addr().(*vsock.Addr)
	if !ok {
		l.Close()
		return nil, 0, fmt.Errorf("vsock listener has address %v", l.Addr())
	}
	return l, addr.Port, nil
}

// MapCID routes messages from guest cid to vmID.
func (r *Router) MapCID(cid uint32, vmID string) {
	r.mu.Lock()
	r.cids[cid] = vmID
	r.mu.Unlock()
}

// UnmapCID stops routing messages from cid.
func (r *Router) UnmapCID(cid uint32) {
	r.mu.Lock()
	delete(r.cids, cid)
	r.mu.Unlock()
}

func (r *Router) vmOfCID(cid uint32) (string, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	vm, ok := r.cids[cid]
	return vm, ok
}

// ServeVsock accepts one connection per message on l (the guest writes the
// message and closes), routes it by the peer's CID, and returns nil when ctx
// ends or the accept error otherwise. It closes l and waits for its
// connections before returning.
func (r *Router) ServeVsock(ctx context.Context, l Listener) error {
	stop := context.AfterFunc(ctx, func() { l.Close() })
	defer stop()
	defer l.Close()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := l.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, unix.EMFILE) || errors.Is(err, unix.ENFILE) || errors.Is(err, unix.ECONNABORTED) {
				time.Sleep(50 * time.Millisecond) // out of descriptors: let connections finish
				continue
			}
			return err
		}
		addr, ok := c.RemoteAddr().(*vsock.Addr)
		if !ok || !r.acquireCID(addr.ContextID) {
			// One guest must not tie up the listener for all of them.
			r.refused.Add(1)
			c.Close()
			continue
		}
		wg.Go(func() {
			defer r.releaseCID(addr.ContextID)
			r.handleVsock(ctx, c, addr)
		})
	}
}

func (r *Router) acquireCID(cid uint32) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.open[cid] >= r.vsockPerCID {
		return false
	}
	r.open[cid]++
	return true
}

func (r *Router) releaseCID(cid uint32) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.open[cid]--; r.open[cid] <= 0 {
		delete(r.open, cid)
	}
}

func (r *Router) handleVsock(ctx context.Context, c net.Conn, from *vsock.Addr) {
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	_ = c.SetReadDeadline(time.Now().Add(r.vsockReadTimeout))
	b, err := io.ReadAll(io.LimitReader(c, MaxMessage+1))
	switch {
	case len(b) > MaxMessage:
		r.oversize.Add(1)
		return
	case err != nil:
		return // deadline or reset before the guest closed: incomplete
	}
	vm, ok := r.vmOfCID(from.ContextID)
	if !ok {
		r.unrouted.Add(1)
		return
	}
	// Only root in the guest binds ports below 1024 (the contract: PID 1).
	r.deliverRaw(vm, b, from.Port < 1024)
}
