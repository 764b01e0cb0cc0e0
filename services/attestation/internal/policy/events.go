package policy

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"strings"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/measure"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
)

// typeIPL is how systemd-stub logs its section events in the firmware log.
const typeIPL = "EV_IPL"

// nameEvents compares the events the policy expects in pcr (expected, its
// words from index firstWord on) with the replayed ones, by position. It
// names nothing (ok false) unless the replayed events of pcr extend it from
// zero to its quoted value: only then are their digests what the TPM saw.
// first names the first event that differs, for the rejection's reason.
func nameEvents(pcr uint32, expected []measure.Event, firstWord int, replayed []verify.Event, quoted []byte) (ms []*attestationv1.EventMismatch, first string, ok bool) {
	var got []verify.Event
	fold := measure.Zero()
	for _, e := range replayed {
		if e.PCR == pcr {
			got = append(got, e)
			fold = measure.Extend(fold, e.Digest)
		}
	}
	if !bytes.Equal(fold, quoted) {
		return nil, "", false
	}
	exp := make([]verify.Event, len(expected))
	for i, e := range expected {
		typ := typeIPL
		if i >= firstWord {
			typ = verify.TypeUserspace
		}
		exp[i] = verify.Event{PCR: pcr, Type: typ, Description: e.Description, Digest: e.Digest}
	}
	first = firstDifference(exp, got, firstWord)
	if first == "" {
		// The same events, yet the PCR differs from the policy's value:
		// the document's pcr11 or pcr13 disagrees with what it computes
		// (stored before Validate checked that). Name nothing.
		return nil, "", false
	}
	return verify.Mismatches(exp, got, []uint32{pcr}), first, true
}

// firstDifference names the first position where got differs from exp.
func firstDifference(exp, got []verify.Event, firstWord int) string {
	for i := range max(len(exp), len(got)) {
		switch {
		case i >= len(got):
			return fmt.Sprintf("%s missing (expected %s)", exp[i].Description, short(exp[i].Digest))
		case i >= len(exp):
			return fmt.Sprintf("unexpected %s (%s)", described(got[i]), short(got[i].Digest))
		case bytes.Equal(exp[i].Digest, got[i].Digest):
		case i >= firstWord && got[i].Type == verify.TypeUserspace:
			// Both are words: the log's says what was extended instead
			// (pkg/measure marks a word its digest does not match).
			return fmt.Sprintf("%s (expected %s)", got[i].Description, exp[i].Description)
		default:
			// The log's description of what came instead, unless it is
			// the expected section's own name (a changed section).
			instead := ""
			if !strings.HasSuffix(exp[i].Description, " "+got[i].Description) {
				instead = ": " + described(got[i])
			}
			return fmt.Sprintf("%s (expected %s, got %s%s)", exp[i].Description, short(exp[i].Digest), short(got[i].Digest), instead)
		}
	}
	return ""
}

func described(e verify.Event) string {
	if e.Type == verify.TypeUserspace {
		return e.Description // the event type is in it
	}
	return e.Type + " " + e.Description
}

// short is a digest's first 8 bytes in hex, enough to tell two apart.
func short(d []byte) string {
	if len(d) > 8 {
		d = d[:8]
	}
	return hex.EncodeToString(d)
}
