package tpmfork

import (
	"bytes"
	"crypto"
	_ "crypto/sha1"
	_ "crypto/sha256"
	_ "crypto/sha512"
	"encoding/binary"
	"errors"

	"github.com/google/go-tpm/tpm2"
)

// The integration test needs the parent's measurements as a list of extends,
// which in production come from the verified event logs a guest sends with its
// quote. The test guest has no network to send them over, so the test finds
// the firmware's TCG2 event log in a dump of the guest's RAM and keeps the
// PCRs whose replay gives the parent's real values (the verification).

const evNoAction = 3

// specIDSignature opens the first event of a crypto-agile log.
var specIDSignature = []byte("Spec ID Event03\x00")

type logEvent struct {
	PCR     uint32
	Type    uint32
	Digests []Extend // one per bank
}

// findEventLogs parses every crypto-agile log in mem (the firmware's log
// area and the EFI stub's copy are both there) and returns the longest.
func findEventLogs(mem []byte) []logEvent {
	var best []logEvent
	for off := 0; ; {
		i := bytes.Index(mem[off:], specIDSignature)
		if i < 0 {
			return best
		}
		at := off + i
		off = at + 1
		if evs, err := parseLog(mem, at-32); err == nil && len(evs) > len(best) {
			best = evs
		}
	}
}

var algHash = map[uint16]crypto.Hash{
	uint16(tpm2.TPMAlgSHA1): crypto.SHA1, uint16(tpm2.TPMAlgSHA256): crypto.SHA256,
	uint16(tpm2.TPMAlgSHA384): crypto.SHA384, uint16(tpm2.TPMAlgSHA512): crypto.SHA512,
}

// parseLog reads a TCG PC Client crypto-agile log (little-endian) starting at
// its TCG_PCR_EVENT header, until the first zeroed or implausible event.
func parseLog(mem []byte, start int) ([]logEvent, error) {
	bad := errors.New("not an event log")
	if start < 0 || start+32 > len(mem) {
		return nil, bad
	}
	le := binary.LittleEndian
	p := mem[start:]
	if le.Uint32(p[0:]) != 0 || le.Uint32(p[4:]) != evNoAction || !bytes.Equal(p[8:28], make([]byte, 20)) {
		return nil, bad
	}
	size := int(le.Uint32(p[28:]))
	if size < 29 || 32+size > len(p) {
		return nil, bad
	}
	spec := p[32 : 32+size]
	n := int(le.Uint32(spec[24:]))
	if n == 0 || n > 8 || 28+4*n > len(spec) {
		return nil, bad
	}
	sizes := map[uint16]int{}
	for i := range n {
		alg, sz := le.Uint16(spec[28+4*i:]), int(le.Uint16(spec[30+4*i:]))
		if h, ok := algHash[alg]; !ok || h.Size() != sz {
			return nil, bad
		}
		sizes[alg] = sz
	}
	p = p[32+size:]
	var evs []logEvent
	for len(p) >= 12 && len(evs) < 10000 {
		pcr, typ, count := le.Uint32(p[0:]), le.Uint32(p[4:]), int(le.Uint32(p[8:]))
		if (pcr == 0 && typ == 0) || pcr > 23 || count != n {
			break
		}
		q := p[12:]
		ev := logEvent{PCR: pcr, Type: typ}
		ok := true
		for range count {
			if len(q) < 2 {
				ok = false
				break
			}
			alg := le.Uint16(q)
			sz, known := sizes[alg]
			if !known || len(q) < 2+sz {
				ok = false
				break
			}
			ev.Digests = append(ev.Digests, Extend{PCR: pcr, Bank: tpm2.TPMAlgID(alg), Digest: bytes.Clone(q[2 : 2+sz])})
			q = q[2+sz:]
		}
		if !ok || len(q) < 4 {
			break
		}
		esz := int(le.Uint32(q))
		if esz > 1<<20 || 4+esz > len(q) {
			break
		}
		evs = append(evs, ev)
		p = q[4+esz:]
	}
	if len(evs) == 0 {
		return nil, bad
	}
	return evs, nil
}

// replayLog folds the log's sha256 digests per PCR.
func replayLog(evs []logEvent) map[uint32][]byte {
	out := map[uint32][]byte{}
	for _, e := range evs {
		if e.Type == evNoAction {
			continue
		}
		for _, d := range e.Digests {
			if d.Bank != tpm2.TPMAlgSHA256 {
				continue
			}
			v, ok := out[e.PCR]
			if !ok {
				v = make([]byte, 32)
			}
			h := crypto.SHA256.New()
			h.Write(v)
			h.Write(d.Digest)
			out[e.PCR] = h.Sum(nil)
		}
	}
	return out
}

// extendsFor is the replay list of the given PCRs, every bank, in log order.
func extendsFor(evs []logEvent, pcrs map[uint32]bool) []Extend {
	var out []Extend
	for _, e := range evs {
		if e.Type != evNoAction && pcrs[e.PCR] {
			out = append(out, e.Digests...)
		}
	}
	return out
}
