// Package verify is the cryptographic half of TPM quote verification
// (contract §5.4 steps 4–10): it parses and checks the attest, the
// attestation key and the signature, binds the quote to a nonce and to the
// PCR values the guest sent, and replays the optional firmware and userspace
// event logs against the quoted PCRs. Policy, storage and nonce bookkeeping
// live elsewhere.
package verify

import (
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/google/go-tpm/tpm2"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/sdk/enumname"
)

// Quote is a quote as the guest posts it (contract §5.2), already
// base64/hex-decoded.
type Quote struct {
	Stage attestationv1.Stage
	// AKPub is the AK's TPMT_PUBLIC; a TPM2B_PUBLIC (2-byte size prefix) is
	// accepted too.
	AKPub []byte
	// Attest is the TPMS_ATTEST the TPM signed.
	Attest []byte
	// Signature is the TPMT_SIGNATURE over Attest.
	Signature []byte
	// PCRs are the sha256 bank values the guest read, by index.
	PCRs map[uint32][]byte
	// EventLog is binary_bios_measurements (TCG PC Client, crypto-agile);
	// optional.
	EventLog []byte
	// UserspaceLog is the guest's tpm2-measure.log (pkg/measure's format):
	// the extends after the firmware's, e.g. boot phases; optional.
	UserspaceLog []byte
	// Key, optional, is a key parsed before (the VM's registered AK): when
	// AKPub is its encoding it is not parsed again. Any other AKPub is.
	Key *AK
}

// Result is what a verified quote proves.
type Result struct {
	// AKPub is the normalized TPMT_PUBLIC (no size prefix): what gets pinned.
	AKPub []byte
	// AKFingerprint is the hex SHA-256 of AKPub.
	AKFingerprint string
	// PCRs are exactly the quoted selection.
	PCRs map[uint32][]byte
	// Events are the logs' events of the quoted PCRs, the event log's in
	// its order, then the userspace log's, when the logs were given and
	// replay to the quoted values. When only the userspace log does not,
	// they are the event log's alone, if it replays by itself.
	Events []Event
	// EventLogError says why a given log was not usable. It never rejects
	// the quote by itself.
	EventLogError string
}

// Event is one measured event of a replayed log. Only PCR and Digest are
// proven by the replay; Type and Description come from the log's
// unmeasured fields and are hints for an operator.
type Event struct {
	PCR         uint32
	Type        string // e.g. EV_EFI_BOOT_SERVICES_APPLICATION, or TypeUserspace
	Description string // firmware volume, variable name, file path, text or short hex; a userspace record's word
	Digest      []byte // sha256
}

// Rejection is a quote that fails verification; Reason says why.
type Rejection struct {
	Reason string
}

func (r *Rejection) Error() string { return r.Reason }

func reject(format string, args ...any) *Rejection {
	return &Rejection{Reason: fmt.Sprintf(format, args...)}
}

// RequiredPCRs returns the sha256 PCRs a quote must cover at stage (contract
// §5.3): 0–7 and 11 at initrd, plus 13 at ready. Unknown stages need none.
func RequiredPCRs(stage attestationv1.Stage) []uint32 {
	switch stage {
	case attestationv1.Stage_STAGE_INITRD:
		return []uint32{0, 1, 2, 3, 4, 5, 6, 7, 11}
	case attestationv1.Stage_STAGE_READY:
		return []uint32{0, 1, 2, 3, 4, 5, 6, 7, 11, 13}
	}
	return nil
}

func stageName(s attestationv1.Stage) string { return enumname.Of(s) }

const pcrSize = sha256.Size

// Check verifies q against nonce: contract §5.4 steps 4–10, in order, after
// the stage (step 2). The first failure returns a *Rejection. An empty nonce
// is the caller's mistake and returns a plain error.
func Check(q Quote, nonce []byte) (*Result, error) {
	if len(nonce) == 0 {
		return nil, errors.New("verify: empty nonce")
	}
	switch q.Stage {
	case attestationv1.Stage_STAGE_INITRD, attestationv1.Stage_STAGE_READY:
	case attestationv1.Stage_STAGE_UNSPECIFIED:
		return nil, reject("unspecified stage")
	default:
		return nil, reject("unknown stage %d", int32(q.Stage))
	}

	// Step 4: parse.
	att, sel, info, rej := parseAttest(q.Attest)
	if rej != nil {
		return nil, rej
	}
	ak := q.Key
	if ak == nil || !bytes.Equal(stripTPM2B(q.AKPub), ak.raw) {
		if ak, rej = parseAK(q.AKPub); rej != nil {
			return nil, rej
		}
	}
	sig, rej := parseSignature(q.Signature, ak)
	if rej != nil {
		return nil, rej
	}

	// Step 5: signature over the attest bytes.
	h := sig.hash.New()
	h.Write(q.Attest)
	if !sig.verify(ak, h.Sum(nil)) {
		return nil, reject("quote signature does not verify")
	}

	// Step 6: qualifying data.
	if subtle.ConstantTimeCompare(att.ExtraData.Buffer, nonce) != 1 {
		return nil, reject("qualifying data does not match the nonce")
	}

	// Step 7: bank.
	if sel.Hash != tpm2.TPMAlgSHA256 {
		return nil, reject("quote is over the %s pcr bank, want sha256", algName(sel.Hash))
	}

	// Step 8: values.
	idxs := selectedPCRs(sel.PCRSelect)
	pcrs := make(map[uint32][]byte, len(idxs))
	for _, i := range idxs {
		v, ok := q.PCRs[i]
		if !ok {
			return nil, reject("pcr %d is quoted but missing from the pcr values", i)
		}
		if len(v) != pcrSize {
			return nil, reject("pcr %d value is %d bytes, want %d", i, len(v), pcrSize)
		}
		pcrs[i] = bytes.Clone(v)
	}

	// Step 9: digest. TPM2_Quote hashes the PCRs with the signing scheme's
	// hash, which is sha256 for the AKs the guest makes.
	h = sig.hash.New()
	for _, i := range idxs {
		h.Write(pcrs[i])
	}
	if subtle.ConstantTimeCompare(h.Sum(nil), info.PCRDigest.Buffer) != 1 {
		return nil, reject("pcr digest does not match the pcr values")
	}

	// Step 10: coverage.
	var missing []string
	for _, i := range RequiredPCRs(q.Stage) {
		if _, ok := pcrs[i]; !ok {
			missing = append(missing, fmt.Sprint(i))
		}
	}
	switch len(missing) {
	case 0:
	case 1:
		return nil, reject("quote does not cover pcr %s, required at the %s stage", missing[0], stageName(q.Stage))
	default:
		return nil, reject("quote does not cover pcrs %s, required at the %s stage", strings.Join(missing, ", "), stageName(q.Stage))
	}

	res := &Result{
		AKPub:         bytes.Clone(ak.raw),
		AKFingerprint: ak.fp,
		PCRs:          pcrs,
	}
	if len(q.EventLog) > 0 || len(q.UserspaceLog) > 0 {
		events, err := replayLogs(q.EventLog, q.UserspaceLog, pcrs)
		if err != nil {
			res.EventLogError = err.Error()
		}
		res.Events = events
	}
	return res, nil
}

const (
	tpmGeneratedValue = 0xff544347
	stAttestQuote     = 0x8018
)

// parseAttest decodes a TPMS_ATTEST that must be a quote over one bank.
func parseAttest(b []byte) (*tpm2.TPMSAttest, *tpm2.TPMSPCRSelection, *tpm2.TPMSQuoteInfo, *Rejection) {
	// Magic and type first, so garbage gets a precise reason.
	if len(b) < 6 {
		return nil, nil, nil, reject("attest is %d bytes, too short for a TPMS_ATTEST", len(b))
	}
	if m := binary.BigEndian.Uint32(b); m != tpmGeneratedValue {
		return nil, nil, nil, reject("attest magic is 0x%08x, not TPM_GENERATED_VALUE", m)
	}
	if t := binary.BigEndian.Uint16(b[4:]); t != stAttestQuote {
		return nil, nil, nil, reject("attest type is 0x%04x, not ATTEST_QUOTE", t)
	}
	if att, sel, info, ok := fastAttest(b); ok {
		return att, sel, info, nil
	}
	att, err := tpm2.Unmarshal[tpm2.TPMSAttest](b)
	if err != nil {
		return nil, nil, nil, reject("attest does not parse: %v", err)
	}
	info, err := att.Attested.Quote()
	if err != nil {
		return nil, nil, nil, reject("attest does not parse: %v", err)
	}
	// The decoder ignores trailing bytes and short size fields; a faithful
	// re-encoding catches both.
	if !bytes.Equal(tpm2.Marshal(*att), b) {
		return nil, nil, nil, reject("attest is not a canonical TPMS_ATTEST (trailing or truncated bytes)")
	}
	if n := len(info.PCRSelect.PCRSelections); n != 1 {
		return nil, nil, nil, reject("quote selects %d pcr banks, want exactly one", n)
	}
	return att, &info.PCRSelect.PCRSelections[0], info, nil
}

// selectedPCRs lists the indexes set in a pcrSelect bitmap, ascending.
func selectedPCRs(bitmap []byte) []uint32 {
	var out []uint32
	for i, b := range bitmap {
		for bit := range 8 {
			if b&(1<<bit) != 0 {
				out = append(out, uint32(i*8+bit))
			}
		}
	}
	return out
}

// sortedKeys returns m's keys ascending.
func sortedKeys[V any](m map[uint32]V) []uint32 {
	out := make([]uint32, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
