package tpmfork

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// fakeSwtpm answers the control protocol as swtpm does and checks that each
// message other than a state blob arrives in one read, as swtpm needs.
type fakeSwtpm struct {
	t        *testing.T
	ln       *net.UnixListener
	blobRC   map[BlobType]uint32
	mu       sync.Mutex
	cmds     []uint32
	blobs    map[BlobType][]byte
	allBytes []byte // every byte received, to look for the parent's
	dataFD   *os.File
}

func newFakeSwtpm(t *testing.T, dir string) *fakeSwtpm {
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(dir, "swtpm.sock"), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeSwtpm{t: t, ln: ln, blobRC: map[BlobType]uint32{}, blobs: map[BlobType][]byte{}}
	t.Cleanup(func() { ln.Close() })
	go f.serve()
	return f
}

func (f *fakeSwtpm) serve() {
	for {
		c, err := f.ln.AcceptUnix()
		if err != nil {
			return
		}
		f.conn(c)
		c.Close()
	}
}

func (f *fakeSwtpm) conn(c *net.UnixConn) {
	buf := make([]byte, 64<<10)
	for {
		oob := make([]byte, syscall.CmsgSpace(16))
		n, oobn, _, _, err := c.ReadMsgUnix(buf, oob)
		if err != nil || n < 4 {
			return
		}
		msg := append([]byte(nil), buf[:n]...)
		cmd := binary.BigEndian.Uint32(msg)
		if oobn > 0 {
			cms, _ := syscall.ParseSocketControlMessage(oob[:oobn])
			fds, _ := syscall.ParseUnixRights(&cms[0])
			f.mu.Lock()
			f.dataFD = os.NewFile(uintptr(fds[0]), "data")
			f.mu.Unlock()
		}
		rsp := []byte{0, 0, 0, 0}
		switch size, ok := requestSize(cmd); {
		case cmd == CmdSetStateBlob:
			for len(msg) < 16 || len(msg) < 16+int(binary.BigEndian.Uint32(msg[12:])) {
				k, err := c.Read(buf)
				if err != nil {
					return
				}
				msg = append(msg, buf[:k]...)
			}
			bt := BlobType(binary.BigEndian.Uint32(msg[8:]))
			f.mu.Lock()
			f.blobs[bt] = msg[16:]
			binary.BigEndian.PutUint32(rsp, f.blobRC[bt])
			f.mu.Unlock()
		case ok && n != 4+size:
			f.t.Errorf("command %#x came in a read of %d bytes, not %d", cmd, n, 4+size)
		case cmd == CmdGetCapability:
			rsp = make([]byte, 8)
		}
		f.mu.Lock()
		f.cmds = append(f.cmds, cmd)
		f.allBytes = append(f.allBytes, msg...)
		f.mu.Unlock()
		if _, err := c.Write(rsp); err != nil {
			return
		}
	}
}

// fakeQEMU writes requests as QEMU's tpm_emulator does.
type fakeQEMU struct {
	t *testing.T
	c *net.UnixConn
}

func dialProxy(t *testing.T, path string) *fakeQEMU {
	c, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return &fakeQEMU{t: t, c: c}
}

func (q *fakeQEMU) send(cmd uint32, body []byte, fds ...int) {
	q.t.Helper()
	msg := append(binary.BigEndian.AppendUint32(nil, cmd), body...)
	var oob []byte
	if len(fds) > 0 {
		oob = syscall.UnixRights(fds...)
	}
	if _, _, err := q.c.WriteMsgUnix(msg, oob, nil); err != nil {
		q.t.Fatal(err)
	}
}

// setBlob writes the header and then the body, as QEMU does.
func (q *fakeQEMU) setBlob(t BlobType, blob []byte) {
	q.t.Helper()
	h := binary.BigEndian.AppendUint32(nil, 0)
	h = binary.BigEndian.AppendUint32(h, uint32(t))
	h = binary.BigEndian.AppendUint32(h, uint32(len(blob)))
	q.send(CmdSetStateBlob, h)
	// A proxy that refuses the header may have cut the connection by now:
	// the caller looks at what it answers, not at this write.
	if _, err := q.c.Write(blob); err != nil {
		q.t.Logf("blob body: %v", err)
	}
}

// result reads a response of n bytes and returns its result code.
func (q *fakeQEMU) result(n int) (uint32, error) {
	b := make([]byte, n)
	if _, err := io.ReadFull(q.c, b); err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint32(b), nil
}

func (q *fakeQEMU) ok(n int) {
	q.t.Helper()
	if rc, err := q.result(n); err != nil || rc != 0 {
		q.t.Fatalf("response: %#x, %v", rc, err)
	}
}

var (
	parentPerm = bytes.Repeat([]byte("PARENT-PERMANENT"), 300)
	parentVol  = bytes.Repeat([]byte("PARENT-VOLATILE."), 600)
	forkBlobs  = Blobs{Permanent: bytes.Repeat([]byte("fork-permanent"), 250), Volatile: bytes.Repeat([]byte("fork-volatile"), 700)}
)

func startProxy(t *testing.T) (*Proxy, *fakeSwtpm, *fakeQEMU) {
	dir := t.TempDir()
	sw := newFakeSwtpm(t, dir)
	p, err := Listen(filepath.Join(dir, "proxy.sock"), filepath.Join(dir, "swtpm.sock"), forkBlobs, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p, sw, dialProxy(t, filepath.Join(dir, "proxy.sock"))
}

// TestProxyIncomingMigration replays what QEMU 7.2 sent in the integration
// test: at start SET_DATAFD, GET_CAPABILITY, STOP, SET_BUFFERSIZE; on the
// incoming migration STOP, the two blobs, INIT.
func TestProxyIncomingMigration(t *testing.T) {
	p, sw, q := startProxy(t)
	pair, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	ours := os.NewFile(uintptr(pair[0]), "ours")
	defer ours.Close()
	q.send(CmdSetDataFD, nil, pair[1])
	syscall.Close(pair[1])
	q.ok(4)
	q.send(CmdGetCapability, nil)
	q.ok(8)
	q.send(CmdStop, nil)
	q.ok(4)
	q.send(CmdSetBufferSize, []byte{0, 0, 0x0f, 0x80})
	q.ok(4)
	q.send(CmdStop, nil)
	q.ok(4)
	q.setBlob(BlobPermanent, parentPerm)
	q.ok(4)
	q.setBlob(BlobVolatile, parentVol)
	q.ok(4)
	q.send(CmdInit, []byte{0, 0, 0, 0})
	q.ok(4)
	if err := p.Check(); err != nil {
		t.Fatal(err)
	}

	sw.mu.Lock()
	defer sw.mu.Unlock()
	if !bytes.Equal(sw.blobs[BlobPermanent], forkBlobs.Permanent) || !bytes.Equal(sw.blobs[BlobVolatile], forkBlobs.Volatile) {
		t.Error("swtpm did not get the fork's blobs")
	}
	if bytes.Contains(sw.allBytes, []byte("PARENT")) {
		t.Error("the parent's state reached swtpm")
	}
	// The data channel swtpm got is the socket QEMU passed.
	if sw.dataFD == nil {
		t.Fatal("no descriptor reached swtpm")
	}
	if _, err := sw.dataFD.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 4)
	if _, err := io.ReadFull(ours, b); err != nil || string(b) != "ping" {
		t.Errorf("data channel: %q, %v", b, err)
	}
	want := []uint32{CmdSetDataFD, CmdGetCapability, CmdStop, CmdSetBufferSize, CmdStop, CmdSetStateBlob, CmdSetStateBlob, CmdInit}
	if got := sw.cmds; !equalU32(got, want) {
		t.Errorf("swtpm got %#x, want %#x", got, want)
	}
	subs := p.Substitutions()
	if len(subs) != 2 || subs[0].ParentLen != len(parentPerm) || subs[1].ForkLen != len(forkBlobs.Volatile) || !subs[1].Answered {
		t.Errorf("substitutions %+v", subs)
	}
	if m := p.Messages(); len(m) != 8 || m[0].FDs != 1 || m[5].Type != BlobPermanent {
		t.Errorf("messages %+v", m)
	}
}

// TestProxyFailsClosed: anything the proxy cannot frame, or a second blob of
// a type (the parent's state again), cuts the connection and fails Check;
// nothing of the parent's reaches swtpm.
func TestProxyFailsClosed(t *testing.T) {
	tests := map[string]func(q *fakeQEMU){
		"second permanent blob": func(q *fakeQEMU) {
			q.setBlob(BlobPermanent, parentPerm)
			q.ok(4)
			q.setBlob(BlobPermanent, parentPerm)
		},
		"unknown command": func(q *fakeQEMU) { q.send(0x99, []byte{1, 2, 3, 4}) },
		"unknown blob type": func(q *fakeQEMU) {
			q.setBlob(7, parentPerm)
		},
		"oversized blob": func(q *fakeQEMU) {
			q.send(CmdSetStateBlob, []byte{0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 0xff, 0xff, 0xff})
		},
		"descriptor with another command": func(q *fakeQEMU) {
			f, err := os.Open(os.DevNull)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			q.send(CmdGetCapability, nil, int(f.Fd()))
		},
		"truncated blob": func(q *fakeQEMU) {
			h := []byte{0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0x10, 0}
			q.send(CmdSetStateBlob, h)
			q.c.Write(parentPerm[:100])
			q.c.CloseWrite()
		},
	}
	for name, do := range tests {
		t.Run(name, func(t *testing.T) {
			p, sw, q := startProxy(t)
			do(q)
			if _, err := q.result(4); err == nil {
				t.Error("the proxy answered instead of cutting the connection")
			}
			if err := p.Check(); err == nil {
				t.Error("Check passed")
			} else {
				t.Logf("Check: %v", err)
			}
			sw.mu.Lock()
			defer sw.mu.Unlock()
			if bytes.Contains(sw.allBytes, []byte("PARENT")) {
				t.Error("the parent's state reached swtpm")
			}
		})
	}
}

func TestProxyCheckNeedsBothBlobsAccepted(t *testing.T) {
	p, sw, q := startProxy(t)
	sw.mu.Lock()
	sw.blobRC[BlobVolatile] = 0x9 // TPM_FAIL
	sw.mu.Unlock()
	q.setBlob(BlobPermanent, parentPerm)
	q.ok(4)
	if err := p.Check(); err == nil || !strings.Contains(err.Error(), "volatile") {
		t.Errorf("Check without a volatile blob: %v", err)
	}
	q.setBlob(BlobVolatile, parentVol)
	if rc, err := q.result(4); err != nil || rc != 0x9 {
		t.Fatalf("QEMU got %#x, %v; want swtpm's 0x9", rc, err)
	}
	if err := p.Check(); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Errorf("Check after swtpm refused the blob: %v", err)
	}
}

func equalU32(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}
