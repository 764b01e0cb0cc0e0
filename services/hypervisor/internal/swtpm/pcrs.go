package swtpm

import (
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/giantswarm/vm-manager/pkg/vtpm"
	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// cmdSetDataFD is CMD_SET_DATAFD of swtpm's control protocol: the request
// carries a socket as SCM_RIGHTS, which becomes the TPM's data channel. It
// is how QEMU's tpm-emulator connects, and the only way to reach an swtpm
// started with --ctrl alone.
const cmdSetDataFD = 16

// DataChannel connects to the TPM of an swtpm that no QEMU holds (one
// started with Linger, after its QEMU ended): it hands swtpm one end of a
// socket pair over the control socket. Without CMD_INIT the TPM keeps its
// state, PCRs included. ctx bounds the whole use of the channel.
func DataChannel(ctx context.Context, ctrlSocket string) (transport.TPMCloser, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", ctrlSocket)
	if err != nil {
		return nil, fmt.Errorf("%w: control socket: %v", ErrUnresponsive, err)
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	defer stop()

	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	ours, theirs := os.NewFile(uintptr(fds[0]), "swtpm-data"), os.NewFile(uintptr(fds[1]), "swtpm-data-peer")
	defer theirs.Close()
	data, err := net.FileConn(ours)
	ours.Close()
	if err != nil {
		return nil, err
	}
	req := binary.BigEndian.AppendUint32(nil, cmdSetDataFD)
	if _, _, err := c.(*net.UnixConn).WriteMsgUnix(req, syscall.UnixRights(int(theirs.Fd())), nil); err != nil {
		data.Close()
		return nil, fmt.Errorf("CMD_SET_DATAFD: %w", err)
	}
	var rc [4]byte
	if _, err := io.ReadFull(c, rc[:]); err != nil {
		data.Close()
		return nil, fmt.Errorf("CMD_SET_DATAFD answer: %w", err)
	}
	if v := binary.BigEndian.Uint32(rc[:]); v != 0 {
		data.Close()
		return nil, fmt.Errorf("CMD_SET_DATAFD: result code %#x", v)
	}
	context.AfterFunc(ctx, func() { _ = data.SetDeadline(time.Now()) })
	return vtpm.FromConn(data), nil
}

// ReadPCRs reads sha256 PCRs through DataChannel: the values a boot left.
func ReadPCRs(ctx context.Context, ctrlSocket string, pcrs []uint) (map[uint32][]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	t, err := DataChannel(ctx, ctrlSocket)
	if err != nil {
		return nil, err
	}
	defer t.Close()
	out := map[uint32][]byte{}
	// TPM2_PCR_Read answers at most 8 digests per call.
	for start := 0; start < len(pcrs); start += 8 {
		batch := pcrs[start:min(start+8, len(pcrs))]
		sel := tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{Hash: tpm2.TPMAlgSHA256, PCRSelect: tpm2.PCClientCompatible.PCRs(batch...)}}}
		rsp, err := (tpm2.PCRRead{PCRSelectionIn: sel}).Execute(t)
		if err != nil {
			return nil, fmt.Errorf("TPM2_PCR_Read: %w", err)
		}
		got := selected(rsp.PCRSelectionOut)
		if len(got) != len(rsp.PCRValues.Digests) {
			return nil, fmt.Errorf("TPM2_PCR_Read: %d PCRs selected, %d digests", len(got), len(rsp.PCRValues.Digests))
		}
		for i, idx := range got {
			out[idx] = rsp.PCRValues.Digests[i].Buffer
		}
	}
	for _, idx := range pcrs {
		if _, ok := out[uint32(idx)]; !ok {
			return nil, fmt.Errorf("TPM2_PCR_Read did not return pcr %d", idx)
		}
	}
	return out, nil
}

// selected lists the sha256 PCRs of a selection, ascending.
func selected(sel tpm2.TPMLPCRSelection) []uint32 {
	var out []uint32
	for _, s := range sel.PCRSelections {
		if s.Hash != tpm2.TPMAlgSHA256 {
			continue
		}
		for i, b := range s.PCRSelect {
			for bit := range 8 {
				if b&(1<<bit) != 0 {
					out = append(out, uint32(i*8+bit))
				}
			}
		}
	}
	return out
}
