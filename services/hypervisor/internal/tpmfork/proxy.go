package tpmfork

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"sync"
	"syscall"
)

// Message is one control request the proxy relayed (or refused), for logs
// and tests: the framing QEMU really uses.
type Message struct {
	Cmd uint32
	Len int // body bytes after the command code
	FDs int // file descriptors passed with it
	// For CMD_SET_STATEBLOB: the blob type and the parent's blob length.
	Type BlobType
}

// Substitution is one CMD_SET_STATEBLOB whose payload the proxy replaced.
type Substitution struct {
	Type        BlobType
	ParentLen   int    // the parent's blob, discarded
	ParentFlags uint32 // its state_flags
	ForkLen     int    // what swtpm got instead
	Answered    bool   // swtpm answered it
	Result      uint32 // swtpm's result code; 0 is success
}

// Proxy serves a unix socket in place of swtpm's control socket for one
// fork's QEMU, relays to the fork's real swtpm control socket, and replaces
// every state blob QEMU sets with the fork's own. Each blob type is replaced
// at most once: a second CMD_SET_STATEBLOB of a type would be the parent's
// state again, so the proxy cuts the connection instead (fail closed), as it
// does on any message it cannot frame.
type Proxy struct {
	ln    *net.UnixListener
	ctrl  string
	blobs Blobs
	logf  func(format string, args ...any)

	mu      sync.Mutex
	conns   map[net.Conn]struct{}
	subs    map[BlobType]*Substitution
	pending *Substitution // forwarded, its result not read yet
	msgs    []Message
	fatal   error
	closed  bool
	handled chan struct{} // closed when the first QEMU connection ended

	wg sync.WaitGroup
}

// maxFDs is how many descriptors one read accepts before it counts as
// malformed; QEMU passes one, with CMD_SET_DATAFD.
const maxFDs = 4

// Listen serves path (replacing a stale socket there) and relays each QEMU
// connection to swtpm's control socket at swtpmCtrl. logf may be nil.
func Listen(path, swtpmCtrl string, blobs Blobs, logf func(string, ...any)) (*Proxy, error) {
	if len(blobs.Permanent) == 0 || len(blobs.Volatile) == 0 {
		return nil, errors.New("tpmfork: the fork's permanent and volatile blobs are required")
	}
	for _, b := range [][]byte{blobs.Permanent, blobs.Volatile, blobs.SaveState} {
		if len(b) > MaxBlob {
			return nil, fmt.Errorf("tpmfork: blob of %d bytes exceeds %d", len(b), MaxBlob)
		}
	}
	if logf == nil {
		logf = func(string, ...any) {}
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode().Type() != fs.ModeSocket {
			return nil, fmt.Errorf("tpmfork: %s exists and is not a socket", path)
		}
		if err := os.Remove(path); err != nil {
			return nil, err
		}
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, err
	}
	// Only the hypervisor's user (QEMU runs as it) may talk to the TPM.
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, err
	}
	p := &Proxy{ln: ln, ctrl: swtpmCtrl, blobs: blobs, logf: logf,
		conns: map[net.Conn]struct{}{}, subs: map[BlobType]*Substitution{}, handled: make(chan struct{})}
	p.wg.Add(1)
	go p.serve()
	return p, nil
}

// Close stops listening, cuts the connections and waits for their relays.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	err := p.ln.Close()
	p.wg.Wait()
	return err
}

// Messages lists the requests seen so far, in order.
func (p *Proxy) Messages() []Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Message(nil), p.msgs...)
}

// Substitutions lists the blobs replaced so far.
func (p *Proxy) Substitutions() []Substitution {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []Substitution
	for _, t := range []BlobType{BlobPermanent, BlobVolatile, BlobSaveState} {
		if s := p.subs[t]; s != nil {
			out = append(out, *s)
		}
	}
	return out
}

// Check says whether the fork may run: swtpm accepted the fork's permanent
// and volatile blobs, every substitution succeeded and no connection was cut
// for a protocol error. Call it after migrate-incoming and before cont.
func (p *Proxy) Check() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fatal != nil {
		return fmt.Errorf("tpmfork: control channel cut: %w", p.fatal)
	}
	for _, t := range []BlobType{BlobPermanent, BlobVolatile} {
		if p.subs[t] == nil {
			return fmt.Errorf("tpmfork: QEMU set no %v blob: the fork's vTPM state is not its own", t)
		}
	}
	for _, s := range p.subs {
		switch {
		case !s.Answered:
			return fmt.Errorf("tpmfork: swtpm has not answered the %v blob", s.Type)
		case s.Result != 0:
			return fmt.Errorf("tpmfork: swtpm refused the %v blob: result code %#x", s.Type, s.Result)
		}
	}
	return nil
}

func (p *Proxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.AcceptUnix()
		if err != nil {
			return
		}
		// One at a time, as swtpm serves one control client at a time.
		if err := p.handle(c); err != nil && !errors.Is(err, io.EOF) && !p.isClosed() {
			p.logf("tpmfork: control connection: %v", err)
		}
	}
}

func (p *Proxy) isClosed() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.closed
}

func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		c.Close()
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *Proxy) fail(err error) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fatal == nil {
		p.fatal = err
	}
	return err
}

// handle relays one QEMU connection until either side closes.
func (p *Proxy) handle(qc *net.UnixConn) error {
	if !p.track(qc) {
		return nil
	}
	sc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: p.ctrl, Net: "unix"})
	if err != nil {
		qc.Close()
		return p.fail(fmt.Errorf("dial swtpm control socket: %w", err))
	}
	if !p.track(sc) {
		qc.Close()
		return nil
	}
	defer func() {
		qc.Close()
		sc.Close()
		p.mu.Lock()
		delete(p.conns, qc)
		delete(p.conns, sc)
		p.mu.Unlock()
	}()
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.relayResponses(sc, qc)
		qc.Close() // unblocks the request loop
	}()
	err = p.relayRequests(qc, sc)
	sc.Close()
	<-done
	p.mu.Lock()
	select {
	case <-p.handled:
	default:
		close(p.handled)
	}
	p.mu.Unlock()
	return err
}

// Handled is closed once the first QEMU connection ended (QEMU exited):
// a proxy process has served its fork then.
func (p *Proxy) Handled() <-chan struct{} { return p.handled }

// relayResponses copies swtpm's answers to QEMU as they come (their length
// depends on the command and on success). After a substituted blob it takes
// the 4-byte result first: QEMU sends nothing before it has read it, so those
// are the next bytes swtpm writes.
func (p *Proxy) relayResponses(sc, qc *net.UnixConn) {
	buf := make([]byte, 64<<10)
	var rc [4]byte
	got := 0
	for {
		n, err := sc.Read(buf)
		if n > 0 {
			p.mu.Lock()
			if s := p.pending; s != nil {
				k := copy(rc[got:], buf[:n])
				if got += k; got == 4 {
					s.Answered, s.Result = true, binary.BigEndian.Uint32(rc[:])
					p.pending, got = nil, 0
					p.logf("tpmfork: swtpm answered the fork's %v blob (%d bytes): result %#x", s.Type, s.ForkLen, s.Result)
				}
			}
			p.mu.Unlock()
			if _, werr := qc.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// relayRequests reads QEMU's requests one whole message at a time and sends
// each to swtpm in one write: swtpm takes one read as one message (it reads
// further only for a state blob's or hash data's body).
func (p *Proxy) relayRequests(qc, sc *net.UnixConn) error {
	for {
		if err := p.relayOne(qc, sc); err != nil {
			return err
		}
	}
}

func (p *Proxy) relayOne(qc, sc *net.UnixConn) error {
	r := &reader{c: qc}
	defer r.closeFDs()
	var hdr [4]byte
	if err := r.full(hdr[:]); err != nil {
		if errors.Is(err, io.EOF) || p.isClosed() {
			return err // QEMU closed between messages, or Close
		}
		return p.fail(err)
	}
	cmd := binary.BigEndian.Uint32(hdr[:])
	if cmd == CmdSetStateBlob {
		return p.setStateBlob(r, sc)
	}
	m := Message{Cmd: cmd}
	var body []byte
	switch n, ok := requestSize(cmd); {
	case ok:
		body = make([]byte, n)
		if err := r.full(body); err != nil {
			return p.fail(fmt.Errorf("command %#x: %w", cmd, err))
		}
	case cmd == CmdHashData:
		var l [4]byte
		if err := r.full(l[:]); err != nil {
			return p.fail(fmt.Errorf("CMD_HASH_DATA: %w", err))
		}
		n := binary.BigEndian.Uint32(l[:])
		if n > 4096 { // ptm_hdata's data[4096]
			return p.fail(fmt.Errorf("%w: CMD_HASH_DATA of %d bytes", errMalformed, n))
		}
		body = append(l[:], make([]byte, n)...)
		if err := r.full(body[4:]); err != nil {
			return p.fail(fmt.Errorf("CMD_HASH_DATA: %w", err))
		}
	default:
		p.record(m)
		return p.fail(fmt.Errorf("%w: unknown command %#x", errMalformed, cmd))
	}
	m.Len, m.FDs = len(body), len(r.fds)
	p.record(m)
	if len(r.fds) > 0 && (cmd != CmdSetDataFD || len(r.fds) != 1) {
		return p.fail(fmt.Errorf("%w: %d descriptors with command %#x", errMalformed, len(r.fds), cmd))
	}
	msg := append(hdr[:], body...)
	if len(r.fds) == 1 {
		// swtpm takes the data channel from this message's SCM_RIGHTS.
		if _, _, err := sc.WriteMsgUnix(msg, syscall.UnixRights(r.fds...), nil); err != nil {
			return err
		}
		return nil
	}
	_, err := sc.Write(msg)
	return err
}

// setStateBlob reads the parent's blob (header, then body: QEMU writes them
// separately) and sends the fork's instead.
func (p *Proxy) setStateBlob(r *reader, sc *net.UnixConn) error {
	var h [12]byte // state_flags, type, length
	if err := r.full(h[:]); err != nil {
		return p.fail(fmt.Errorf("CMD_SET_STATEBLOB header: %w", err))
	}
	flags, t, n := binary.BigEndian.Uint32(h[0:]), BlobType(binary.BigEndian.Uint32(h[4:])), binary.BigEndian.Uint32(h[8:])
	p.record(Message{Cmd: CmdSetStateBlob, Len: 12 + int(n), FDs: len(r.fds), Type: t})
	switch {
	case len(r.fds) > 0:
		return p.fail(fmt.Errorf("%w: descriptors with CMD_SET_STATEBLOB", errMalformed))
	case t != BlobPermanent && t != BlobVolatile && t != BlobSaveState:
		return p.fail(fmt.Errorf("%w: CMD_SET_STATEBLOB of %v", errMalformed, t))
	case n > MaxBlob:
		return p.fail(fmt.Errorf("%w: CMD_SET_STATEBLOB %v of %d bytes (limit %d)", errMalformed, t, n, MaxBlob))
	}
	if _, err := io.CopyN(io.Discard, r, int64(n)); err != nil {
		return p.fail(fmt.Errorf("CMD_SET_STATEBLOB %v body: %w", t, err))
	}
	if len(r.fds) > 0 {
		return p.fail(fmt.Errorf("%w: descriptors with CMD_SET_STATEBLOB", errMalformed))
	}
	fork := p.blobs.get(t)
	p.mu.Lock()
	if p.subs[t] != nil {
		p.mu.Unlock()
		return p.fail(fmt.Errorf("%w: a second %v blob: refusing to pass the parent's state", errMalformed, t))
	}
	s := &Substitution{Type: t, ParentLen: int(n), ParentFlags: flags, ForkLen: len(fork)}
	p.subs[t], p.pending = s, s
	p.mu.Unlock()
	p.logf("tpmfork: replacing the parent's %v blob (%d bytes, flags %#x) with the fork's (%d bytes)", t, n, flags, len(fork))

	msg := binary.BigEndian.AppendUint32(nil, CmdSetStateBlob)
	msg = binary.BigEndian.AppendUint32(msg, p.blobs.Flags&stateFlagEncrypted)
	msg = binary.BigEndian.AppendUint32(msg, uint32(t))
	msg = binary.BigEndian.AppendUint32(msg, uint32(len(fork)))
	_, err := sc.Write(append(msg, fork...))
	return err
}

func (p *Proxy) record(m Message) {
	p.mu.Lock()
	p.msgs = append(p.msgs, m)
	p.mu.Unlock()
	if m.Cmd == CmdSetStateBlob {
		p.logf("tpmfork: QEMU -> swtpm command %#x (%v, %d bytes)", m.Cmd, m.Type, m.Len)
	} else {
		p.logf("tpmfork: QEMU -> swtpm command %#x (%d bytes, %d fds)", m.Cmd, m.Len, m.FDs)
	}
}

// reader reads exactly what a message needs, never beyond it, and collects
// the descriptors any of those reads carried.
type reader struct {
	c   *net.UnixConn
	fds []int
}

func (r *reader) Read(b []byte) (int, error) {
	oob := make([]byte, syscall.CmsgSpace(maxFDs*4))
	n, oobn, flags, _, err := r.c.ReadMsgUnix(b, oob)
	if oobn > 0 {
		msgs, perr := syscall.ParseSocketControlMessage(oob[:oobn])
		if perr != nil {
			return n, perr
		}
		for _, m := range msgs {
			fds, perr := syscall.ParseUnixRights(&m)
			if perr != nil {
				return n, perr
			}
			r.fds = append(r.fds, fds...)
		}
	}
	if flags&syscall.MSG_CTRUNC != 0 {
		return n, fmt.Errorf("%w: more than %d descriptors", errMalformed, maxFDs)
	}
	if n == 0 && err == nil {
		err = io.EOF
	}
	return n, err
}

func (r *reader) full(b []byte) error {
	_, err := io.ReadFull(r, b)
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("%w: truncated", errMalformed)
	}
	return err
}

func (r *reader) closeFDs() {
	for _, fd := range r.fds {
		syscall.Close(fd)
	}
	r.fds = nil
}
