package tpmfork

import (
	"bytes"
	"crypto"
	_ "crypto/sha1" // the banks a log may have
	_ "crypto/sha256"
	_ "crypto/sha512"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/google/go-tpm/tpm2"
)

// A fork's PCRs are brought to its parent's by replaying the measurements
// of the parent's last verified quote: the firmware's TCG2 event log (every
// bank it has) and the userspace log vm-agent and systemd keep (every bank
// its records name). Both came from the guest: they are parsed as hostile
// input, and a fork whose replay does not give the golden values fails its
// own attestation like any boot.

// Bounds of what a replay takes.
const (
	maxEvents     = 10000
	maxEventBytes = 1 << 20
)

const evNoAction = 3

var algHash = map[uint16]crypto.Hash{
	uint16(tpm2.TPMAlgSHA1): crypto.SHA1, uint16(tpm2.TPMAlgSHA256): crypto.SHA256,
	uint16(tpm2.TPMAlgSHA384): crypto.SHA384, uint16(tpm2.TPMAlgSHA512): crypto.SHA512,
}

var bankOf = map[string]tpm2.TPMAlgID{
	"sha1": tpm2.TPMAlgSHA1, "sha256": tpm2.TPMAlgSHA256, "sha384": tpm2.TPMAlgSHA384, "sha512": tpm2.TPMAlgSHA512,
}

// Replay is the extends of a verified quote's logs, in log order: the
// firmware's, then the userspace log's (they extend other PCRs).
func Replay(firmware, userspace []byte) ([]Extend, error) {
	var out []Extend
	if len(firmware) > 0 {
		evs, err := parseEvents(firmware, true)
		if err != nil {
			return nil, fmt.Errorf("firmware event log: %w", err)
		}
		for _, e := range evs {
			if e.Type != evNoAction {
				out = append(out, e.Digests...)
			}
		}
	}
	if len(userspace) > 0 {
		us, err := userspaceExtends(userspace)
		if err != nil {
			return nil, fmt.Errorf("userspace log: %w", err)
		}
		out = append(out, us...)
	}
	return out, checkReplay(out)
}

type logEvent struct {
	PCR     uint32
	Type    uint32
	Digests []Extend // one per bank
}

var errNotLog = errors.New("not a crypto-agile TCG event log")

// parseEvents reads a TCG PC Client crypto-agile log (little-endian) from its
// TCG_PCR_EVENT header. Strict: the whole buffer is events (zero padding at
// the end allowed); otherwise it stops at the first zeroed or implausible
// event (a log found in memory).
func parseEvents(p []byte, strict bool) ([]logEvent, error) {
	le := binary.LittleEndian
	if len(p) < 32 || le.Uint32(p[0:]) != 0 || le.Uint32(p[4:]) != evNoAction || !bytes.Equal(p[8:28], make([]byte, 20)) {
		return nil, errNotLog
	}
	size := int(le.Uint32(p[28:]))
	if size < 29 || 32+size > len(p) {
		return nil, errNotLog
	}
	spec := p[32 : 32+size]
	n := int(le.Uint32(spec[24:]))
	if n == 0 || n > 8 || 28+4*n > len(spec) {
		return nil, errNotLog
	}
	sizes := map[uint16]int{}
	for i := range n {
		alg, sz := le.Uint16(spec[28+4*i:]), int(le.Uint16(spec[30+4*i:]))
		if h, ok := algHash[alg]; !ok || h.Size() != sz {
			return nil, fmt.Errorf("%w: bank %#x of %d bytes", errNotLog, alg, sz)
		}
		sizes[alg] = sz
	}
	p = p[32+size:]
	var evs []logEvent
	bad := func(format string, args ...any) ([]logEvent, error) {
		if !strict && len(evs) > 0 {
			return evs, nil
		}
		return nil, fmt.Errorf("event %d: "+format, append([]any{len(evs) + 1}, args...)...)
	}
	for len(p) > 0 {
		if len(p) < 12 {
			if bytes.Count(p, []byte{0}) == len(p) {
				break
			}
			return bad("truncated header")
		}
		pcr, typ, count := le.Uint32(p[0:]), le.Uint32(p[4:]), int(le.Uint32(p[8:]))
		if pcr == 0 && typ == 0 && bytes.Count(p, []byte{0}) == len(p) {
			break // padding
		}
		if len(evs) >= maxEvents {
			return bad("more than %d events", maxEvents)
		}
		if pcr > 23 || count != n {
			return bad("PCR %d with %d digests (the log has %d banks)", pcr, count, n)
		}
		q := p[12:]
		ev := logEvent{PCR: pcr, Type: typ}
		for range count {
			if len(q) < 2 {
				return bad("truncated digest")
			}
			alg := le.Uint16(q)
			sz, known := sizes[alg]
			if !known || len(q) < 2+sz {
				return bad("digest of bank %#x", alg)
			}
			ev.Digests = append(ev.Digests, Extend{PCR: pcr, Bank: tpm2.TPMAlgID(alg), Digest: bytes.Clone(q[2 : 2+sz])})
			q = q[2+sz:]
		}
		if len(q) < 4 {
			return bad("truncated event size")
		}
		esz := int(le.Uint32(q))
		if esz > maxEventBytes || 4+esz > len(q) {
			return bad("event data of %d bytes", esz)
		}
		evs = append(evs, ev)
		p = q[4+esz:]
	}
	if len(evs) == 0 {
		return nil, errNotLog
	}
	return evs, nil
}

// userspaceExtends reads systemd's tpm2-measure.log (JSON-SEQ, or JSON
// lines): each record's digests, every bank it names.
func userspaceExtends(b []byte) ([]Extend, error) {
	var out []Extend
	for i, raw := range bytes.FieldsFunc(b, func(r rune) bool { return r == 0x1e || r == '\n' }) {
		raw = bytes.TrimSpace(raw)
		if len(raw) == 0 {
			continue
		}
		if i >= measure.MaxLogRecords {
			return nil, fmt.Errorf("more than %d records", measure.MaxLogRecords)
		}
		var r measure.Record
		if err := json.Unmarshal(raw, &r); err != nil {
			return nil, fmt.Errorf("entry %d is not a record: %v", i+1, err)
		}
		if len(r.Digests) == 0 {
			return nil, fmt.Errorf("entry %d has no digest", i+1)
		}
		for _, d := range r.Digests {
			bank, ok := bankOf[d.HashAlg]
			if !ok {
				return nil, fmt.Errorf("entry %d: unknown bank %q", i+1, d.HashAlg)
			}
			v, err := hex.DecodeString(d.Digest)
			if err != nil || len(v) != algHash[uint16(bank)].Size() {
				return nil, fmt.Errorf("entry %d: %s digest is not %d bytes of hex", i+1, d.HashAlg, algHash[uint16(bank)].Size())
			}
			out = append(out, Extend{PCR: r.PCR, Bank: bank, Digest: v})
		}
	}
	return out, nil
}
