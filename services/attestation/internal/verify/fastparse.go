package verify

import (
	"encoding/binary"

	"github.com/google/go-tpm/tpm2"
)

// Fast paths for the two structures every quote carries. go-tpm decodes by
// reflection, and the canonical re-encoding the checks need costs as much
// again: together more than the ECDSA check itself. These decoders take only
// the common, well-formed shape (a quote over one sha256 bank, an ECDSA
// signature), consume the input exactly (which is what canonical means for
// these fixed layouts) and return what go-tpm would. Anything else, well
// formed or not, goes to go-tpm's path, which words the rejection: the fast
// paths never reject. FuzzFastParsers holds them to go-tpm's results.

// reader takes big-endian fields off a byte slice; ok turns false for good
// at the first field that does not fit.
type reader struct {
	b  []byte
	ok bool
}

func (r *reader) take(n int) []byte {
	if !r.ok || len(r.b) < n {
		r.ok = false
		return nil
	}
	out := r.b[:n:n]
	r.b = r.b[n:]
	return out
}

func (r *reader) u8() uint8 {
	if b := r.take(1); b != nil {
		return b[0]
	}
	return 0
}

func (r *reader) u16() uint16 {
	if b := r.take(2); b != nil {
		return binary.BigEndian.Uint16(b)
	}
	return 0
}

func (r *reader) u32() uint32 {
	if b := r.take(4); b != nil {
		return binary.BigEndian.Uint32(b)
	}
	return 0
}

func (r *reader) u64() uint64 {
	if b := r.take(8); b != nil {
		return binary.BigEndian.Uint64(b)
	}
	return 0
}

// sized is a TPM2B: a 16-bit size, then that many bytes. The bytes are
// copied, as go-tpm's are, so a result does not alias the request.
func (r *reader) sized() []byte {
	n := int(r.u16())
	b := r.take(n)
	if b == nil {
		return nil
	}
	return append(make([]byte, 0, n), b...)
}

// fastAttest decodes a TPMS_ATTEST of type quote over exactly one sha256
// bank whose selection is 1 to 4 bytes.
func fastAttest(b []byte) (*tpm2.TPMSAttest, *tpm2.TPMSPCRSelection, *tpm2.TPMSQuoteInfo, bool) {
	r := &reader{b: b, ok: true}
	att := &tpm2.TPMSAttest{}
	att.Magic = tpm2.TPMGenerated(r.u32())
	att.Type = tpm2.TPMISTAttest(r.u16())
	if !r.ok || att.Magic != tpmGeneratedValue || att.Type != stAttestQuote {
		return nil, nil, nil, false
	}
	att.QualifiedSigner.Buffer = r.sized()
	att.ExtraData.Buffer = r.sized()
	att.ClockInfo.Clock = r.u64()
	att.ClockInfo.ResetCount = r.u32()
	att.ClockInfo.RestartCount = r.u32()
	safe := r.u8()
	att.ClockInfo.Safe = safe == 1
	att.FirmwareVersion = r.u64()
	if count := r.u32(); count != 1 || safe > 1 {
		return nil, nil, nil, false
	}
	sel := tpm2.TPMSPCRSelection{Hash: tpm2.TPMIAlgHash(r.u16())}
	n := int(r.u8())
	if sel.Hash != tpm2.TPMAlgSHA256 || n < 1 || n > 4 {
		return nil, nil, nil, false
	}
	sel.PCRSelect = append(make([]byte, 0, n), r.take(n)...)
	info := &tpm2.TPMSQuoteInfo{
		PCRSelect: tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{sel}},
		PCRDigest: tpm2.TPM2BDigest{Buffer: r.sized()},
	}
	if !r.ok || len(r.b) != 0 {
		return nil, nil, nil, false
	}
	att.Attested = tpm2.NewTPMUAttest(tpm2.TPMSTAttestQuote, info)
	return att, &info.PCRSelect.PCRSelections[0], info, true
}

// fastSignature decodes a TPMT_SIGNATURE of scheme ECDSA.
func fastSignature(b []byte) (*tpm2.TPMTSignature, bool) {
	r := &reader{b: b, ok: true}
	if tpm2.TPMIAlgSigScheme(r.u16()) != tpm2.TPMAlgECDSA || !r.ok {
		return nil, false
	}
	e := &tpm2.TPMSSignatureECC{Hash: tpm2.TPMIAlgHash(r.u16())}
	e.SignatureR.Buffer = r.sized()
	e.SignatureS.Buffer = r.sized()
	if !r.ok || len(r.b) != 0 {
		return nil, false
	}
	return &tpm2.TPMTSignature{SigAlg: tpm2.TPMAlgECDSA, Signature: tpm2.NewTPMUSignature(tpm2.TPMAlgECDSA, e)}, true
}
