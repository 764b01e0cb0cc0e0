package measure

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
)

// DefaultLogPath is where systemd keeps its userspace measurement log, and
// where vm-agent writes its own in the same format.
const DefaultLogPath = "/run/log/systemd/tpm2-measure.log"

// Limits of a log a guest sends: it is hostile input.
const (
	MaxLogRecords = 1024
	MaxWordBytes  = 4096
)

// Event types of the records vm-agent writes (systemd's names).
const (
	EventTypePhase       = "phase"
	EventTypeOSSeparator = "os-separator"
	EventTypeSysext      = "sysext"
	// EventTypeVerityRoot is vm-agent's own: the verity root of an OCI
	// image (systemd has no such record).
	EventTypeVerityRoot = "verity-root"
)

// Record is one line of systemd's tpm2-measure.log: a JSON object in a JSON
// text sequence (RFC 7464: an RS byte before, a newline after).
type Record struct {
	PCR         uint32         `json:"pcr"`
	Digests     []RecordDigest `json:"digests"`
	ContentType string         `json:"content_type"`
	Content     RecordContent  `json:"content"`
}

// RecordDigest is one bank's digest of a record.
type RecordDigest struct {
	HashAlg string `json:"hashAlg"`
	Digest  string `json:"digest"`
}

// RecordContent is what was measured: the word, and systemd's context.
type RecordContent struct {
	String    string `json:"string"`
	BootID    string `json:"bootId,omitempty"`
	Timestamp uint64 `json:"timestamp,omitempty"`
	EventType string `json:"eventType,omitempty"`
}

const rs = 0x1e

// WordRecord is the record of extending word into pcr.
func WordRecord(pcr uint32, word, eventType, bootID string, usec uint64) Record {
	return Record{
		PCR:         pcr,
		Digests:     []RecordDigest{{HashAlg: "sha256", Digest: hex.EncodeToString(Digest([]byte(word)))}},
		ContentType: "systemd",
		Content:     RecordContent{String: word, BootID: bootID, Timestamp: usec, EventType: eventType},
	}
}

// WriteRecord appends r to w as one JSON-SEQ entry.
func WriteRecord(w io.Writer, r Record) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	buf := make([]byte, 0, len(b)+2)
	buf = append(buf, rs)
	buf = append(buf, b...)
	buf = append(buf, '\n')
	_, err = w.Write(buf)
	return err
}

// ParseLog reads a userspace log into events of the sha256 bank. Entries
// may be RS-separated (systemd) or plain JSON lines. A record without a
// sha256 digest, with a malformed digest, or beyond MaxLogRecords is an
// error: a log that cannot be read whole cannot be replayed.
func ParseLog(b []byte) ([]Event, error) {
	var out []Event
	for i, raw := range bytes.FieldsFunc(b, func(r rune) bool { return r == rs || r == '\n' }) {
		raw = bytes.TrimSpace(raw)
		if len(raw) == 0 {
			continue
		}
		if len(out) >= MaxLogRecords {
			return nil, fmt.Errorf("userspace log has more than %d records", MaxLogRecords)
		}
		var r Record
		if err := json.Unmarshal(raw, &r); err != nil {
			return nil, fmt.Errorf("userspace log entry %d is not a record: %v", i+1, err)
		}
		var d []byte
		for _, rd := range r.Digests {
			if rd.HashAlg == "sha256" {
				v, err := hex.DecodeString(rd.Digest)
				if err != nil || len(v) != 32 {
					return nil, fmt.Errorf("userspace log entry %d: sha256 digest is not 32 bytes of hex", i+1)
				}
				d = v
			}
		}
		if d == nil {
			return nil, fmt.Errorf("userspace log entry %d has no sha256 digest", i+1)
		}
		word := r.Content.String
		if len(word) > MaxWordBytes {
			word = word[:MaxWordBytes]
		}
		desc := fmt.Sprintf("%q", word)
		// The word is the record's claim; only the digest is replayed.
		// Say when the two disagree, so the claim is not taken for fact.
		if !bytes.Equal(Digest([]byte(r.Content.String)), d) {
			desc += " (not what the digest measured)"
		}
		if r.Content.EventType != "" {
			desc = r.Content.EventType + " " + desc
		}
		out = append(out, Event{PCR: r.PCR, Description: desc, Digest: d})
	}
	return out, nil
}
