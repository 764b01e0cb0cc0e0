package tpmfork

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/google/go-tpm/tpm2"
)

// cryptoAgileLog is a TCG2 log with a sha256 bank: the Spec ID event, then
// one event per (pcr, data), each digest the data's SHA-256.
func cryptoAgileLog(events ...struct {
	pcr  uint32
	data string
}) []byte {
	le := binary.LittleEndian
	var b bytes.Buffer
	spec := make([]byte, 24, 33)
	copy(spec, "Spec ID Event03\x00")
	spec = le.AppendUint32(spec, 1)                         // one bank
	spec = le.AppendUint16(spec, uint16(tpm2.TPMAlgSHA256)) // sha256
	spec = le.AppendUint16(spec, 32)
	spec = append(spec, 0) // no vendor info
	hdr := le.AppendUint32(nil, 0)
	hdr = le.AppendUint32(hdr, evNoAction)
	hdr = append(hdr, make([]byte, 20)...)
	hdr = le.AppendUint32(hdr, uint32(len(spec)))
	b.Write(hdr)
	b.Write(spec)
	for _, e := range events {
		d := sha256.Sum256([]byte(e.data))
		ev := le.AppendUint32(nil, e.pcr)
		ev = le.AppendUint32(ev, 0x0d) // EV_IPL
		ev = le.AppendUint32(ev, 1)
		ev = le.AppendUint16(ev, uint16(tpm2.TPMAlgSHA256))
		ev = append(ev, d[:]...)
		ev = le.AppendUint32(ev, uint32(len(e.data)))
		ev = append(ev, e.data...)
		b.Write(ev)
	}
	return b.Bytes()
}

type ev = struct {
	pcr  uint32
	data string
}

func TestReplayTakesBothLogs(t *testing.T) {
	fw := cryptoAgileLog(ev{4, "kernel"}, ev{9, "initrd"})
	var us bytes.Buffer
	if err := measure.WriteRecord(&us, measure.WordRecord(11, "enter-initrd", "phase", "", 0)); err != nil {
		t.Fatal(err)
	}
	got, err := Replay(append(fw, make([]byte, 7)...), us.Bytes()) // zero padding after the events is allowed
	if err != nil {
		t.Fatal(err)
	}
	kernel := sha256.Sum256([]byte("kernel"))
	if len(got) < 3 || got[0].PCR != 4 || !bytes.Equal(got[0].Digest, kernel[:]) || got[1].PCR != 9 || got[2].PCR != 11 {
		t.Fatalf("replay %+v", got)
	}
	for _, e := range got[2:] {
		if e.PCR != 11 || len(e.Digest) == 0 {
			t.Errorf("userspace extend %+v", e)
		}
	}
}

// The logs are the guest's: anything malformed is refused, nothing of it
// replayed.
func TestReplayRefusesMalformedLogs(t *testing.T) {
	fw := cryptoAgileLog(ev{4, "kernel"}, ev{9, "initrd"})
	for name, c := range map[string]struct{ fw, us []byte }{
		"truncated event":     {fw: fw[:len(fw)-3]},
		"garbage after":       {fw: append(bytes.Clone(fw), 0xff, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)},
		"not a log":           {fw: []byte("MZ this is not a log at all, not even its header")},
		"dynamic PCR":         {fw: cryptoAgileLog(ev{17, "drtm"})},
		"bad digest":          {us: []byte(`{"pcr":11,"digests":[{"hashAlg":"sha256","digest":"zz"}],"content":{"string":"x"}}`)},
		"unknown bank":        {us: []byte(`{"pcr":11,"digests":[{"hashAlg":"md5","digest":"00"}],"content":{"string":"x"}}`)},
		"record without bank": {us: []byte(`{"pcr":11,"digests":[],"content":{"string":"x"}}`)},
		"not json":            {us: []byte(`{"pcr":`)},
	} {
		if got, err := Replay(c.fw, c.us); err == nil {
			t.Errorf("%s: replayed %d extends", name, len(got))
		} else if strings.TrimSpace(err.Error()) == "" {
			t.Errorf("%s: empty error", name)
		}
	}
}
