package tpmfork

import (
	"bytes"
	"crypto"
	_ "crypto/sha1"
	_ "crypto/sha256"
	_ "crypto/sha512"

	"github.com/google/go-tpm/tpm2"
)

// The integration test needs the parent's measurements as a list of extends,
// which in production come from the verified event logs a guest sends with its
// quote. The test guest has no network to send them over, so the test finds
// the firmware's TCG2 event log in a dump of the guest's RAM and keeps the
// PCRs whose replay gives the parent's real values (the verification).

// specIDSignature opens the first event of a crypto-agile log.
var specIDSignature = []byte("Spec ID Event03\x00")

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

// parseLog reads the log found in memory at start (replay.go's parser, up
// to the first zeroed or implausible event).
func parseLog(mem []byte, start int) ([]logEvent, error) {
	if start < 0 || start > len(mem) {
		return nil, errNotLog
	}
	return parseEvents(mem[start:], false)
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
