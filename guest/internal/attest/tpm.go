// Package attest is vm-agent's TPM side of attestation (vm-manager contract §5): it
// keeps the attestation key, quotes PCRs for a boot stage and submits the quote to
// the IMDS.
package attest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
	"github.com/google/go-tpm/tpm2/transport/linuxtpm"
)

// DefaultTPMPath is the kernel's resource-managed TPM device.
const DefaultTPMPath = "/dev/tpmrm0"

// OpenTPM opens the TPM at path: a character device, or a unix socket of swtpm's
// server channel (`swtpm socket --tpm2 --server type=unixio,path=...`). A TPM that
// was never started (TPM_RC_INITIALIZE) gets TPM2_Startup(CLEAR).
func OpenTPM(path string) (transport.TPMCloser, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	var t transport.TPMCloser
	if fi.Mode()&os.ModeSocket != 0 {
		c, err := net.Dial("unix", path)
		if err != nil {
			return nil, err
		}
		// FromReadWriteCloser adds go-tpm's TPM_RC_RETRY handling.
		t = transport.FromReadWriteCloser(&socketRW{conn: c})
	} else if t, err = linuxtpm.Open(path); err != nil {
		return nil, err
	}
	if err := startup(t); err != nil {
		t.Close()
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return t, nil
}

func startup(t transport.TPM) error {
	_, err := tpm2.GetCapability{Capability: tpm2.TPMCapTPMProperties, Property: uint32(tpm2.TPMPTManufacturer), PropertyCount: 1}.Execute(t)
	if !errors.Is(err, tpm2.TPMRCInitialize) {
		return err
	}
	if _, err := (tpm2.Startup{StartupType: tpm2.TPMSUClear}).Execute(t); err != nil {
		return fmt.Errorf("TPM2_Startup(CLEAR): %w", err)
	}
	return nil
}

// socketRW frames swtpm's raw command/response stream: go-tpm reads a response with
// a single Read, so Read returns exactly one whole response, however the stream split it.
type socketRW struct {
	mu   sync.Mutex
	conn net.Conn
	rsp  []byte
}

const maxResponse = 1 << 16

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
	if size < 10 || size > maxResponse {
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

// flush frees a transient object or session; errors are moot at that point, and
// without a resource manager (swtpm, /dev/tpm0) a leaked handle stays until reset.
func flush(t transport.TPM, h tpm2.TPMHandle) {
	_, _ = tpm2.FlushContext{FlushHandle: h}.Execute(t)
}
