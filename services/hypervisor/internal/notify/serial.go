package notify

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"time"
)

// Redial backoff of AttachSerial.
const (
	serialMinBackoff = 20 * time.Millisecond
	serialMaxBackoff = time.Second
)

// AttachSerial receives vmID's messages from the unix socket QEMU serves for
// the guest's virtio-serial notify port (chardev server=on,wait=off). It dials
// with backoff while QEMU starts, redials when the connection drops (QEMU
// restarted, or serves us again after a hypervisor restart), and returns when
// ctx ends. Messages are NUL-terminated; what the guest writes while no one
// is connected is lost (QEMU discards it).
func (r *Router) AttachSerial(ctx context.Context, vmID, socket string) {
	var d net.Dialer
	backoff := serialMinBackoff
	for ctx.Err() == nil {
		c, err := d.DialContext(ctx, "unix", socket)
		if err == nil {
			backoff = serialMinBackoff
			r.readSerial(ctx, vmID, c)
		}
		select {
		case <-ctx.Done():
		case <-time.After(backoff):
		}
		if err != nil {
			backoff = min(2*backoff, serialMaxBackoff)
		}
	}
}

func (r *Router) readSerial(ctx context.Context, vmID string, c net.Conn) {
	defer c.Close()
	r.mu.Lock()
	if r.serial == nil {
		r.serial = map[string]net.Conn{}
	}
	r.serial[vmID] = c
	r.mu.Unlock()
	defer func() {
		r.mu.Lock()
		if r.serial[vmID] == c {
			delete(r.serial, vmID)
		}
		r.mu.Unlock()
	}()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	var f framer
	buf := make([]byte, 32<<10)
	for {
		n, err := c.Read(buf)
		f.feed(buf[:n], func(msg []byte) { r.deliverRaw(vmID, msg, true) }, func() { r.oversize.Add(1) })
		if err != nil {
			return // a partial message dies with its connection
		}
	}
}

// framer splits a byte stream into NUL-terminated messages. A message longer
// than MaxMessage is dropped up to its NUL, and the next one survives.
type framer struct {
	buf        []byte
	discarding bool
}

func (f *framer) feed(p []byte, emit func([]byte), oversize func()) {
	for len(p) > 0 {
		i := bytes.IndexByte(p, 0)
		chunk := p
		if i >= 0 {
			chunk = p[:i]
		}
		if !f.discarding {
			if len(f.buf)+len(chunk) > MaxMessage {
				f.discarding, f.buf = true, nil
				oversize()
			} else {
				f.buf = append(f.buf, chunk...)
			}
		}
		if i < 0 {
			return
		}
		if !f.discarding {
			emit(f.buf)
		}
		f.buf, f.discarding = f.buf[:0], false
		p = p[i+1:]
	}
}

// SendSerial writes msg, NUL-terminated, to vmID's guest over its notify
// port, waiting (until ctx ends) for AttachSerial to be connected. The host
// says little this way: a fork learns that it is one (vm-agent's fork.go).
func (r *Router) SendSerial(ctx context.Context, vmID string, msg []byte) error {
	if bytes.IndexByte(msg, 0) >= 0 || len(msg) > MaxMessage {
		return fmt.Errorf("notify: a message to the guest is one frame of at most %d bytes", MaxMessage)
	}
	frame := append(append([]byte(nil), msg...), 0)
	for {
		r.mu.Lock()
		c := r.serial[vmID]
		r.mu.Unlock()
		if c != nil {
			_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
			_, err := c.Write(frame)
			_ = c.SetWriteDeadline(time.Time{})
			return err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("notify: vm %s's notify port is not connected: %w", vmID, ctx.Err())
		case <-time.After(serialMinBackoff):
		}
	}
}
