package vtpm

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/google/go-tpm/tpm2/transport"
)

// DialSocket connects to swtpm's data channel on a unix socket
// (`swtpm socket --server type=unixio,path=...`).
func DialSocket(path string, timeout time.Duration) (transport.TPMCloser, error) {
	c, err := net.DialTimeout("unix", path, timeout)
	if err != nil {
		return nil, err
	}
	return FromConn(c), nil
}

// FromConn frames a TPM command stream on c. FromReadWriteCloser adds
// go-tpm's TPM_RC_RETRY handling.
func FromConn(c net.Conn) transport.TPMCloser {
	return transport.FromReadWriteCloser(&socketRW{conn: c})
}

// socketRW frames swtpm's raw command/response stream: go-tpm reads a
// response with a single Read, so Read returns exactly one whole response,
// however the stream split it.
type socketRW struct {
	mu   sync.Mutex
	conn net.Conn
	rsp  []byte
}

// MaxResponse bounds one TPM response read from a socket.
const MaxResponse = 1 << 16

func (s *socketRW) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n, err := s.conn.Write(p)
	if err != nil {
		return n, err
	}
	var hdr [10]byte // tag, size, response code
	if _, err := io.ReadFull(s.conn, hdr[:]); err != nil {
		return n, fmt.Errorf("reading TPM response: %w", err)
	}
	size := binary.BigEndian.Uint32(hdr[2:6])
	if size < 10 || size > MaxResponse {
		return n, fmt.Errorf("TPM response size %d out of range", size)
	}
	s.rsp = make([]byte, size)
	copy(s.rsp, hdr[:])
	if _, err := io.ReadFull(s.conn, s.rsp[10:]); err != nil {
		return n, fmt.Errorf("reading TPM response: %w", err)
	}
	return n, nil
}

func (s *socketRW) Read(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.rsp == nil {
		return 0, errors.New("TPM read without a command")
	}
	if len(p) < len(s.rsp) {
		return 0, io.ErrShortBuffer
	}
	n := copy(p, s.rsp)
	s.rsp = nil
	return n, nil
}

func (s *socketRW) Close() error { return s.conn.Close() }
