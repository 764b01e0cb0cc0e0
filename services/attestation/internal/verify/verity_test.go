package verify

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"slices"
	"testing"

	"github.com/google/go-tpm/legacy/tpm2"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/measure"
)

// fixtureRoot is the dm-verity root hash of the fixture's OCI root.
var fixtureRoot = hex.EncodeToString(measure.Digest([]byte("oci erofs root")))

// fixtureVerityWord is vm-agent's PCR 15 extend of fixtureRoot.
func fixtureVerityWord() word {
	return word{measure.PCRVerityRoot, measure.VerityRootWord(fixtureRoot), measure.EventTypeVerityRoot}
}

// guestPCRs are what vm-agent quotes (guest/internal/attest StagePCRs):
// more than RequiredPCRs, PCR 15 among them.
var guestPCRs = map[attestationv1.Stage][]int{
	initrd: {0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 15},
	ready:  {0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 13, 15},
}

// The guest's selection with PCR 15 verifies, and vm-agent's verity root
// record replays next to the UKI boot's: PCR 15's event is the root's word.
// A quote without PCR 15 (a guest from before) verifies as ever, the record
// of a PCR it did not quote set aside.
func TestQuoteWithVerityRoot(t *testing.T) {
	f := getFixture(t)
	ulog := slices.Concat(f.userLog, f.verityLog)
	for _, stage := range []attestationv1.Stage{initrd, ready} {
		t.Run(stage.String(), func(t *testing.T) {
			nonce := newNonce(t)
			q := f.quote(t, f.ecc, tpm2.AlgSHA256, guestPCRs[stage], nonce)
			q.Stage, q.EventLog, q.UserspaceLog = stage, f.ukiLog, ulog
			res := mustVerify(t, q, nonce)
			if res.EventLogError != "" {
				t.Fatalf("EventLogError = %q", res.EventLogError)
			}
			if !bytes.Equal(res.PCRs[15], measure.PCR15(fixtureRoot)) {
				t.Errorf("pcr 15 = %x, want %x", res.PCRs[15], measure.PCR15(fixtureRoot))
			}
			checkEventsReplay(t, res.Events, res.PCRs)
			want := []Event{{PCR: 15, Type: TypeUserspace, Description: fmt.Sprintf("verity-root %q", measure.VerityRootWord(fixtureRoot)), Digest: measure.Digest([]byte(measure.VerityRootWord(fixtureRoot)))}}
			if got := ofPCRs(res.Events, 15); !slices.EqualFunc(got, want, eventEqual) {
				t.Errorf("pcr 15 events %+v, want %+v", got, want)
			}

			old := map[attestationv1.Stage][]int{initrd: initrdPCRs, ready: readyPCRs}[stage]
			nonce = newNonce(t)
			q = f.quote(t, f.ecc, tpm2.AlgSHA256, old, nonce)
			q.Stage, q.EventLog, q.UserspaceLog = stage, f.ukiLog, ulog
			res = mustVerify(t, q, nonce)
			if _, quoted := res.PCRs[15]; quoted || res.EventLogError != "" || len(ofPCRs(res.Events, 15)) != 0 {
				t.Errorf("a quote without pcr 15: pcrs %v, events %+v, error %q", sortedKeys(res.PCRs), ofPCRs(res.Events, 15), res.EventLogError)
			}
		})
	}
}
