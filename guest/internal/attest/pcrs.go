package attest

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"slices"

	"github.com/google/go-tpm/tpm2"
	"github.com/google/go-tpm/tpm2/transport"
)

// Stages and the sha256 PCRs each quotes (contract §5.3).
const (
	StageInitrd = "initrd"
	StageReady  = "ready"
)

// StagePCRs returns the PCR indexes quoted at stage, ascending: the
// contract's (0–7 and 11, plus 13 at ready), PCR 9, which holds the initrd and
// command line of a direct-kernel boot under OVMF, PCR 12, where
// systemd-stub 252 measures command-line overrides from boot-entry load
// options when Secure Boot is off, and PCR 15, where vm-agent measures the
// dm-verity root hash it computed over an imported OCI image's root
// (measure.PCRVerityRoot) before the initrd quote; so an image policy can
// pin all three (PCR 12 to zero, PCR 15 to its oci.root_hash). A verifier
// that does not know PCR 15 accepts the larger selection.
func StagePCRs(stage string) ([]uint, error) {
	switch stage {
	case StageInitrd:
		return []uint{0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 15}, nil
	case StageReady:
		return []uint{0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 13, 15}, nil
	}
	return nil, fmt.Errorf("unknown stage %q (want %s or %s)", stage, StageInitrd, StageReady)
}

// Banks maps bank names to their TPM hash algorithms.
var Banks = map[string]tpm2.TPMAlgID{
	"sha1":   tpm2.TPMAlgSHA1,
	"sha256": tpm2.TPMAlgSHA256,
	"sha384": tpm2.TPMAlgSHA384,
	"sha512": tpm2.TPMAlgSHA512,
}

func selection(bank tpm2.TPMAlgID, pcrs []uint) tpm2.TPMLPCRSelection {
	return tpm2.TPMLPCRSelection{PCRSelections: []tpm2.TPMSPCRSelection{{
		Hash:      bank,
		PCRSelect: tpm2.PCClientCompatible.PCRs(pcrs...),
	}}}
}

// ReadPCRs reads the given PCRs of one bank. TPM2_PCR_Read returns at most 8 values
// per call, so it repeats for the rest.
func ReadPCRs(t transport.TPM, bank tpm2.TPMAlgID, pcrs []uint) (map[uint][]byte, error) {
	out := make(map[uint][]byte, len(pcrs))
	for {
		var rest []uint
		for _, i := range pcrs {
			if _, ok := out[i]; !ok {
				rest = append(rest, i)
			}
		}
		if len(rest) == 0 {
			return out, nil
		}
		rsp, err := tpm2.PCRRead{PCRSelectionIn: selection(bank, rest)}.Execute(t)
		if err != nil {
			return nil, fmt.Errorf("reading PCRs: %w", err)
		}
		got := 0
		for _, sel := range rsp.PCRSelectionOut.PCRSelections {
			if sel.Hash != bank {
				continue
			}
			for _, i := range selected(sel.PCRSelect) {
				if got >= len(rsp.PCRValues.Digests) {
					return nil, fmt.Errorf("reading PCRs: TPM returned fewer values than selected")
				}
				out[i] = rsp.PCRValues.Digests[got].Buffer
				got++
			}
		}
		if got == 0 {
			return nil, fmt.Errorf("reading PCRs %v: bank %s is not allocated", rest, bankName(bank))
		}
	}
}

func selected(bitmap []byte) []uint {
	var idx []uint
	for i := range uint(len(bitmap) * 8) {
		if bitmap[i/8]&(1<<(i%8)) != 0 {
			idx = append(idx, i)
		}
	}
	return idx
}

func bankName(alg tpm2.TPMAlgID) string {
	for n, a := range Banks {
		if a == alg {
			return n
		}
	}
	return fmt.Sprintf("%#x", uint16(alg))
}

// Quote is a TPM2_Quote of sha256 PCRs and the values it covers.
type Quote struct {
	Attest    []byte          // TPMS_ATTEST, the signed bytes
	Signature []byte          // TPMT_SIGNATURE
	PCRs      map[uint][]byte // the quoted sha256 values
}

// TakeQuote quotes the sha256 PCRs pcrs with nonce as qualifying data, then reads
// them. If a PCR was extended in between, the values do not hash to the quote's
// pcrDigest, so it quotes again.
func TakeQuote(t transport.TPM, ak *AK, nonce []byte, pcrs []uint) (*Quote, error) {
	pcrs = slices.Sorted(slices.Values(pcrs))
	for attempt := 0; ; attempt++ {
		rsp, err := tpm2.Quote{
			SignHandle:     tpm2.AuthHandle{Handle: ak.Handle, Name: ak.Name, Auth: tpm2.PasswordAuth(nil)},
			QualifyingData: tpm2.TPM2BData{Buffer: nonce},
			InScheme:       tpm2.TPMTSigScheme{Scheme: tpm2.TPMAlgNull}, // the key's ECDSA-SHA256
			PCRSelect:      selection(tpm2.TPMAlgSHA256, pcrs),
		}.Execute(t)
		if err != nil {
			return nil, fmt.Errorf("TPM2_Quote: %w", err)
		}
		values, err := ReadPCRs(t, tpm2.TPMAlgSHA256, pcrs)
		if err != nil {
			return nil, err
		}
		attest, err := rsp.Quoted.Contents()
		if err != nil {
			return nil, fmt.Errorf("parsing the quote: %w", err)
		}
		info, err := attest.Attested.Quote()
		if err != nil {
			return nil, fmt.Errorf("parsing the quote: %w", err)
		}
		h := sha256.New()
		for _, i := range pcrs {
			h.Write(values[i])
		}
		if bytes.Equal(h.Sum(nil), info.PCRDigest.Buffer) {
			return &Quote{Attest: rsp.Quoted.Bytes(), Signature: tpm2.Marshal(rsp.Signature), PCRs: values}, nil
		}
		if attempt == 4 {
			return nil, fmt.Errorf("PCRs keep changing between quote and read")
		}
	}
}
