package network

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/tcpip/transport/udp"
	"gvisor.dev/gvisor/pkg/waiter"
)

// The NAT: every TCP SYN and UDP datagram the stack has no endpoint for is a
// new flow, dialled from the host. These forwarders replace
// gvisor-tap-vsock's so that each flow counts against its VM's bound (and the
// host's) from before the dial until its host socket is closed, and a
// released VM's flows end with it.

func (n *Network) startNAT() {
	s := n.us.stack
	s.SetTransportProtocolHandler(tcp.ProtocolNumber, tcp.NewForwarder(s, 0, maxTCPInFlight, n.forwardTCP).HandlePacket)
	s.SetTransportProtocolHandler(udp.ProtocolNumber, udp.NewForwarder(s, n.forwardUDP).HandlePacket)
}

// admit checks a new flow: a VM's, to a destination the NAT serves, within
// the bounds. Refusals are counted on the VM.
func (n *Network) admit(proto uint8, id stack.TransportEndpointID) (*vmState, flowKey, bool) {
	k := flowKey{proto: proto,
		src: netip.AddrPortFrom(toAddr(id.RemoteAddress), id.RemotePort),
		dst: netip.AddrPortFrom(toAddr(id.LocalAddress), id.LocalPort)}
	vs := n.vmAt(k.src.Addr())
	if vs == nil {
		return nil, k, false // the attach filter lets only leases through
	}
	if refuse, silent := n.egress.natRefuses(proto, k.dst); refuse {
		if !silent {
			vs.egress[egressLocal].Add(1)
			n.egressDropped.Add(1)
			n.log.Debug("NAT refused a flow to an address it does not serve", "vm", vs.id, "dst", k.dst, "proto", proto)
		}
		return nil, k, false
	}
	limit := n.limits.NATTCPPerVM
	if proto == protoUDP {
		limit = n.limits.NATUDPPerVM
	}
	if reason, ok := vs.openFlow(k, limit, n.limits.Host); !ok {
		if reason != natNone {
			vs.nat[reason].Add(1)
			n.log.Debug("NAT refused a flow", "vm", vs.id, "dst", k.dst, "reason", natNames[reason])
		}
		return nil, k, false
	}
	return vs, k, true
}

// forwardTCP runs on its own goroutine (gVisor's forwarder starts one).
func (n *Network) forwardTCP(r *tcp.ForwarderRequest) {
	vs, k, ok := n.admit(protoTCP, r.ID())
	if !ok {
		r.Complete(true)
		return
	}
	ctx, cancel := context.WithTimeout(n.runCtx, natDialTimeout)
	host, err := (&net.Dialer{}).DialContext(ctx, "tcp", k.dst.String())
	cancel()
	if err != nil {
		vs.closeFlow(k, n.limits.Host)
		r.Complete(true)
		return
	}
	var wq waiter.Queue
	ep, terr := r.CreateEndpoint(&wq)
	r.Complete(false)
	if terr != nil {
		_ = host.Close()
		vs.closeFlow(k, n.limits.Host)
		return
	}
	ep.SocketOptions().SetKeepAlive(true)
	idle, intvl := tcpip.KeepaliveIdleOption(natKeepalive), tcpip.KeepaliveIntervalOption(natKeepalive/4)
	_ = ep.SetSockOpt(&idle)
	_ = ep.SetSockOpt(&intvl)
	_ = ep.SetSockOptInt(tcpip.KeepaliveCountOption, 4)
	f := &tcpFlow{guest: gonet.NewTCPConn(&wq, ep), host: host}
	vs.setFlow(k, f)
	f.proxy()
	_ = f.Close()
	vs.closeFlow(k, n.limits.Host)
}

type tcpFlow struct {
	guest *gonet.TCPConn
	host  net.Conn
}

func (f *tcpFlow) Close() error {
	_ = f.guest.Close()
	return f.host.Close()
}

// proxy copies both ways, passing half-closes on, until both ends are done
// or one fails.
func (f *tcpFlow) proxy() {
	var wg sync.WaitGroup
	cp := func(dst, src net.Conn) {
		defer wg.Done()
		// Hiding ReaderFrom/WriterTo makes io.CopyBuffer use this buffer
		// rather than allocate its own.
		_, err := io.CopyBuffer(struct{ io.Writer }{dst}, struct{ io.Reader }{src}, make([]byte, 16<<10))
		if cw, ok := dst.(interface{ CloseWrite() error }); ok && err == nil {
			_ = cw.CloseWrite()
			return
		}
		_ = f.Close()
	}
	wg.Add(2)
	go cp(f.host, f.guest)
	cp(f.guest, f.host)
	wg.Wait()
}

// forwardUDP runs on the stack's delivery path: it must not block.
func (n *Network) forwardUDP(r *udp.ForwarderRequest) {
	vs, k, ok := n.admit(protoUDP, r.ID())
	if !ok {
		return
	}
	host, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(k.dst))
	if err != nil {
		vs.closeFlow(k, n.limits.Host)
		return
	}
	var wq waiter.Queue
	ep, terr := r.CreateEndpoint(&wq) // queues the first datagram on ep
	if terr != nil {
		_ = host.Close()
		vs.closeFlow(k, n.limits.Host)
		return
	}
	f := &udpFlow{ep: ep, wq: &wq, host: host, idle: n.limits.NATUDPIdle, done: make(chan struct{})}
	f.touch()
	vs.setFlow(k, f)
	go func() {
		f.run()
		vs.closeFlow(k, n.limits.Host)
	}()
}

// udpFlow is one guest socket's datagrams to one destination. Buffers come
// from a pool only while a datagram is moved, so an idle flow costs its two
// goroutines and sockets, not 128 KiB.
type udpFlow struct {
	ep   tcpip.Endpoint
	wq   *waiter.Queue
	host *net.UDPConn
	idle time.Duration
	last atomic.Int64 // unix nanoseconds of the last datagram either way
	once sync.Once
	done chan struct{}
}

var udpBufs = sync.Pool{New: func() any { b := make([]byte, 1<<16); return &b }}

func (f *udpFlow) touch() { f.last.Store(time.Now().UnixNano()) }

// idleLeft is how long until the flow has been idle for f.idle (≤0: it has).
func (f *udpFlow) idleLeft() time.Duration {
	return f.idle - time.Since(time.Unix(0, f.last.Load()))
}

func (f *udpFlow) Close() error {
	f.once.Do(func() {
		close(f.done)
		_ = f.host.Close()
		f.ep.Close()
	})
	return nil
}

func (f *udpFlow) run() {
	var wg sync.WaitGroup
	wg.Go(f.fromHost)
	f.fromGuest()
	_ = f.Close()
	wg.Wait()
}

func (f *udpFlow) fromGuest() {
	we, ready := waiter.NewChannelEntry(waiter.ReadableEvents)
	f.wq.EventRegister(&we)
	defer f.wq.EventUnregister(&we)
	timer := time.NewTimer(f.idle)
	defer timer.Stop()
	for {
		buf := udpBufs.Get().(*[]byte)
		w := tcpip.SliceWriter(*buf)
		res, err := f.ep.Read(&w, tcpip.ReadOptions{})
		if err == nil {
			f.touch()
			_, werr := f.host.Write((*buf)[:res.Count])
			udpBufs.Put(buf)
			// A refused earlier datagram (ICMP port unreachable) is
			// reported on a later write; the flow goes on.
			if werr != nil && !errors.Is(werr, unix.ECONNREFUSED) {
				return
			}
			continue
		}
		udpBufs.Put(buf)
		if _, ok := err.(*tcpip.ErrWouldBlock); !ok {
			return
		}
		select {
		case <-ready:
		case <-timer.C:
			left := f.idleLeft()
			if left <= 0 {
				return
			}
			timer.Reset(left)
		case <-f.done:
			return
		}
	}
}

func (f *udpFlow) fromHost() {
	defer f.Close()
	rc, err := f.host.SyscallConn()
	if err != nil {
		return
	}
	for {
		if err := f.host.SetReadDeadline(time.Now().Add(max(f.idleLeft(), time.Millisecond))); err != nil {
			return
		}
		var (
			buf  *[]byte
			k    int
			rerr error
		)
		err := rc.Read(func(fd uintptr) bool {
			buf = udpBufs.Get().(*[]byte)
			k, _, rerr = unix.Recvfrom(int(fd), *buf, unix.MSG_DONTWAIT)
			if rerr == unix.EAGAIN {
				udpBufs.Put(buf)
				buf = nil
				return false
			}
			return true
		})
		switch {
		case errors.Is(err, os.ErrDeadlineExceeded):
			if f.idleLeft() <= 0 {
				return
			}
			continue
		case err != nil:
			return
		case rerr != nil:
			udpBufs.Put(buf)
			if rerr == unix.ECONNREFUSED {
				continue
			}
			return
		}
		f.touch()
		_, werr := f.ep.Write(bytes.NewReader((*buf)[:k]), tcpip.WriteOptions{})
		udpBufs.Put(buf)
		if werr != nil {
			if _, full := werr.(*tcpip.ErrWouldBlock); !full {
				return
			}
		}
	}
}
