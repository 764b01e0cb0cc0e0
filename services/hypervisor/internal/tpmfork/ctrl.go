// Package tpmfork gives a VM forked from a saved (migrated) parent a vTPM of
// its own. The migration stream carries the parent's swtpm state, which QEMU
// hands to the fork's swtpm over the control channel (CMD_SET_STATEBLOB) while
// it loads the stream. Restored as-is, the fork would hold the parent's EK and
// AK. Instead the fork's QEMU talks to a Proxy, which swaps the PERMANENT,
// VOLATILE and SAVESTATE blobs for ones prepared on a host swtpm (Prepare):
// fresh seeds, the fork's own EK and AK, and the parent's PCR values replayed
// from its verified measurements.
package tpmfork

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"time"
)

// Control commands of swtpm's socket protocol (swtpm's tpm_ioctl.h, "Commands
// used by the non-CUSE TPMs"). Every message is big-endian.
const (
	CmdGetCapability       = 0x01
	CmdInit                = 0x02
	CmdShutdown            = 0x03
	CmdGetTPMEstablished   = 0x04
	CmdSetLocality         = 0x05
	CmdHashStart           = 0x06
	CmdHashData            = 0x07
	CmdHashEnd             = 0x08
	CmdCancelTPMCmd        = 0x09
	CmdStoreVolatile       = 0x0a
	CmdResetTPMEstablished = 0x0b
	CmdGetStateBlob        = 0x0c
	CmdSetStateBlob        = 0x0d
	CmdStop                = 0x0e
	CmdGetConfig           = 0x0f
	CmdSetDataFD           = 0x10
	CmdSetBufferSize       = 0x11
	CmdGetInfo             = 0x12
)

// BlobType is a TPM state blob (PTM_BLOB_TYPE_*).
type BlobType uint32

const (
	BlobPermanent BlobType = 1
	BlobVolatile  BlobType = 2
	BlobSaveState BlobType = 3
)

func (t BlobType) String() string {
	switch t {
	case BlobPermanent:
		return "permanent"
	case BlobVolatile:
		return "volatile"
	case BlobSaveState:
		return "savestate"
	}
	return fmt.Sprintf("blob type %d", uint32(t))
}

// stateFlagEncrypted (PTM_STATE_FLAG_ENCRYPTED) marks a blob encrypted with
// swtpm's migration key.
const stateFlagEncrypted = 2

// MaxBlob bounds a state blob either way. libtpms' permanent state is tens of
// KiB (its NV is 128 KiB at most); anything near this is not a TPM state.
const MaxBlob = 1 << 20

// requestSize is the body length (after the 4-byte command) of a request
// whose length does not depend on its content, and false for commands whose
// length does (HASH_DATA, SET_STATEBLOB: a u32 length field) or that are
// unknown. Sizes are those of the req structs in tpm_ioctl.h.
func requestSize(cmd uint32) (int, bool) {
	switch cmd {
	case CmdGetCapability, CmdShutdown, CmdGetTPMEstablished, CmdHashStart,
		CmdHashEnd, CmdCancelTPMCmd, CmdStoreVolatile, CmdStop, CmdGetConfig, CmdSetDataFD:
		return 0, true
	case CmdInit, CmdSetBufferSize:
		return 4, true
	case CmdSetLocality, CmdResetTPMEstablished:
		// QEMU sends the whole ptm_loc / ptm_reset_est union (a u8 request
		// in a u32 response's room), and swtpm reads the first byte.
		return 4, true
	case CmdGetStateBlob:
		return 12, true // state_flags, type, offset
	case CmdGetInfo:
		return 16, true // u64 flags, offset, pad
	}
	return 0, false
}

// Blobs are the TPM state blobs a fork's swtpm is given instead of the
// parent's, as CMD_GET_STATEBLOB returned them (swtpm's own header
// included). Flags are the state_flags to send them with.
type Blobs struct {
	Permanent, Volatile, SaveState []byte
	Flags                          uint32
}

func (b *Blobs) get(t BlobType) []byte {
	switch t {
	case BlobPermanent:
		return b.Permanent
	case BlobVolatile:
		return b.Volatile
	case BlobSaveState:
		return b.SaveState
	}
	return nil
}

// GetStateBlob reads one state blob over an swtpm control socket that no one
// else holds (CMD_GET_STATEBLOB; the TPM must be running). swtpm's socket
// protocol answers the whole blob at once: tpm_result, state_flags,
// totlength, length, then length bytes.
func GetStateBlob(ctx context.Context, ctrlSocket string, t BlobType) (blob []byte, flags uint32, err error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", ctrlSocket)
	if err != nil {
		return nil, 0, err
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	defer stop()
	req := binary.BigEndian.AppendUint32(nil, CmdGetStateBlob)
	req = binary.BigEndian.AppendUint32(req, 0) // state_flags: no decryption asked
	req = binary.BigEndian.AppendUint32(req, uint32(t))
	req = binary.BigEndian.AppendUint32(req, 0) // offset
	if _, err := c.Write(req); err != nil {
		return nil, 0, fmt.Errorf("CMD_GET_STATEBLOB %v: %w", t, err)
	}
	var hdr [16]byte
	if _, err := io.ReadFull(c, hdr[:4]); err != nil {
		return nil, 0, fmt.Errorf("CMD_GET_STATEBLOB %v answer: %w", t, err)
	}
	if rc := binary.BigEndian.Uint32(hdr[:4]); rc != 0 {
		// Errors may come as the result code alone.
		return nil, 0, &ResultError{Cmd: CmdGetStateBlob, Code: rc}
	}
	if _, err := io.ReadFull(c, hdr[4:]); err != nil {
		return nil, 0, fmt.Errorf("CMD_GET_STATEBLOB %v answer: %w", t, err)
	}
	flags = binary.BigEndian.Uint32(hdr[4:8])
	total, n := binary.BigEndian.Uint32(hdr[8:12]), binary.BigEndian.Uint32(hdr[12:16])
	if total != n || n > MaxBlob {
		return nil, 0, fmt.Errorf("CMD_GET_STATEBLOB %v: %d of %d bytes (limit %d)", t, n, total, MaxBlob)
	}
	blob = make([]byte, n)
	if _, err := io.ReadFull(c, blob); err != nil {
		return nil, 0, fmt.Errorf("CMD_GET_STATEBLOB %v body: %w", t, err)
	}
	return blob, flags, nil
}

// ctrlCall sends a request without a body and reads a 4-byte result code.
func ctrlCall(ctx context.Context, ctrlSocket string, cmd uint32) error {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", ctrlSocket)
	if err != nil {
		return err
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	defer stop()
	if _, err := c.Write(binary.BigEndian.AppendUint32(nil, cmd)); err != nil {
		return err
	}
	var rc [4]byte
	if _, err := io.ReadFull(c, rc[:]); err != nil {
		return err
	}
	if v := binary.BigEndian.Uint32(rc[:]); v != 0 {
		return &ResultError{Cmd: cmd, Code: v}
	}
	return nil
}

var errMalformed = errors.New("malformed control message")

// ResultError is a control command's non-zero result code.
type ResultError struct {
	Cmd, Code uint32
}

func (e *ResultError) Error() string {
	return fmt.Sprintf("control command %#x: result code %#x", e.Cmd, e.Code)
}

// NonFatal says the code is a warning (TPM_NON_FATAL, 0x800: TPM_RETRY
// among them). libtpms answers it for a TPM 2's SAVESTATE blob, which it does
// not have, and QEMU takes that blob as empty.
func (e *ResultError) NonFatal() bool { return e.Code&0x800 != 0 }
