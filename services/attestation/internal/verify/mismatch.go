package verify

import (
	"bytes"
	"encoding/hex"
	"slices"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
)

// Mismatches names the events that differ between a golden boot and the
// current one, comparing each PCR's events by position: a changed digest
// (both digests set), an added event (ExpectedDigest empty) or a removed one
// (Digest empty). pcrs limits the comparison, ascending; nil compares every
// PCR either log touches. Positional comparison is deliberate: an inserted
// event also reports the events after it, which is what moved.
func Mismatches(golden, current []Event, pcrs []uint32) []*attestationv1.EventMismatch {
	if pcrs == nil {
		seen := map[uint32]bool{}
		for _, e := range slices.Concat(golden, current) {
			seen[e.PCR] = true
		}
		pcrs = sortedKeys(seen)
	} else {
		pcrs = slices.Clone(pcrs)
		slices.Sort(pcrs)
		pcrs = slices.Compact(pcrs)
	}
	var out []*attestationv1.EventMismatch
	for _, pcr := range pcrs {
		g, c := ofPCR(golden, pcr), ofPCR(current, pcr)
		for i := range max(len(g), len(c)) {
			switch {
			case i >= len(g):
				out = append(out, mismatch(c[i], c[i].Digest, nil))
			case i >= len(c):
				out = append(out, mismatch(g[i], nil, g[i].Digest))
			case !bytes.Equal(g[i].Digest, c[i].Digest):
				out = append(out, mismatch(c[i], c[i].Digest, g[i].Digest))
			}
		}
	}
	return out
}

func ofPCR(evs []Event, pcr uint32) []Event {
	var out []Event
	for _, e := range evs {
		if e.PCR == pcr {
			out = append(out, e)
		}
	}
	return out
}

func mismatch(e Event, digest, expected []byte) *attestationv1.EventMismatch {
	return &attestationv1.EventMismatch{
		Pcr:            e.PCR,
		Type:           e.Type,
		Description:    e.Description,
		Digest:         hex.EncodeToString(digest),
		ExpectedDigest: hex.EncodeToString(expected),
	}
}
