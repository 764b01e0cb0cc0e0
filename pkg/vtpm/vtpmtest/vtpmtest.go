// Package vtpmtest makes TPM quotes in software: a P-256 key that lives
// outside any TPM, whose TPMT_PUBLIC claims the AK template's attributes
// (fixedTPM, restricted, sign), and signs TPMS_ATTEST structures over any
// PCR values. It is what a hostile guest forges (the attack suite runs it
// inside a real guest) and what unit tests quote with where no TPM is at
// hand. A verifier can tell such a key from a real AK only by knowing which
// key is the VM's: the key's own public area proves nothing.
package vtpmtest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"slices"

	"github.com/giantswarm/vm-manager/pkg/vtpm"
	"github.com/google/go-tpm/tpm2"
)

// SoftwareAK is an ECDSA P-256 key posing as an attestation key.
type SoftwareAK struct {
	key *ecdsa.PrivateKey
	// Public is the TPMT_PUBLIC: vtpm.AKTemplate with this key as unique.
	Public []byte
	name   tpm2.TPM2BName
}

// NewSoftwareAK makes a fresh key.
func NewSoftwareAK() (*SoftwareAK, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	pub := vtpm.AKTemplate()
	pub.Unique = tpm2.NewTPMUPublicID(tpm2.TPMAlgECC, &tpm2.TPMSECCPoint{
		X: tpm2.TPM2BECCParameter{Buffer: key.X.FillBytes(make([]byte, 32))},
		Y: tpm2.TPM2BECCParameter{Buffer: key.Y.FillBytes(make([]byte, 32))},
	})
	raw := tpm2.Marshal(pub)
	digest := sha256.Sum256(raw)
	name := tpm2.TPM2BName{Buffer: append([]byte{0x00, 0x0b}, digest[:]...)} // sha256 name
	return &SoftwareAK{key: key, Public: raw, name: name}, nil
}

// Quote returns a TPMS_ATTEST of type quote over the sha256 PCRs given (their
// indexes are the selection), qualified by nonce, and its TPMT_SIGNATURE.
func (k *SoftwareAK) Quote(nonce []byte, pcrs map[uint32][]byte) (attest, signature []byte, err error) {
	idx := make([]uint, 0, len(pcrs))
	for i := range pcrs {
		idx = append(idx, uint(i))
	}
	slices.Sort(idx)
	h := sha256.New()
	for _, i := range idx {
		h.Write(pcrs[uint32(i)])
	}
	att := tpm2.TPMSAttest{
		Magic:           tpm2.TPMGeneratedValue,
		Type:            tpm2.TPMSTAttestQuote,
		QualifiedSigner: k.name,
		ExtraData:       tpm2.TPM2BData{Buffer: nonce},
		ClockInfo:       tpm2.TPMSClockInfo{Clock: 1000, Safe: true},
		Attested: tpm2.NewTPMUAttest(tpm2.TPMSTAttestQuote, &tpm2.TPMSQuoteInfo{
			PCRSelect: tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{
				Hash: tpm2.TPMAlgSHA256, PCRSelect: tpm2.PCClientCompatible.PCRs(idx...),
			}}},
			PCRDigest: tpm2.TPM2BDigest{Buffer: h.Sum(nil)},
		}),
	}
	attest = tpm2.Marshal(att)
	d := sha256.Sum256(attest)
	r, s, err := ecdsa.Sign(rand.Reader, k.key, d[:])
	if err != nil {
		return nil, nil, err
	}
	sig := tpm2.TPMTSignature{
		SigAlg: tpm2.TPMAlgECDSA,
		Signature: tpm2.NewTPMUSignature(tpm2.TPMAlgECDSA, &tpm2.TPMSSignatureECC{
			Hash:       tpm2.TPMAlgSHA256,
			SignatureR: tpm2.TPM2BECCParameter{Buffer: r.Bytes()},
			SignatureS: tpm2.TPM2BECCParameter{Buffer: s.Bytes()},
		}),
	}
	return attest, tpm2.Marshal(sig), nil
}
