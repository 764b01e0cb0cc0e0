package verify

import (
	"bytes"
	"encoding/binary"
	"testing"

	legacy "github.com/google/go-tpm/legacy/tpm2"
	"github.com/google/go-tpm/tpm2"
)

// FuzzFastParsers holds the fast decoders to go-tpm's: what a fast path
// takes, go-tpm decodes to the same values and re-encodes to the same bytes
// (canonical), so the fast path changes no verdict, only its cost. Seeds: a
// simulator quote and signature (sha256 and sha1 banks), an RSA signature,
// and cuts and flips of them.
func FuzzFastParsers(f *testing.F) {
	fx := getFixture(f)
	good := fx.quote(f, fx.ecc, legacy.AlgSHA256, readyPCRs, fuzzNonce)
	sha1 := fx.quote(f, fx.ecc, legacy.AlgSHA1, readyPCRs, fuzzNonce)
	if _, _, _, ok := fastAttest(good.Attest); !ok {
		f.Fatal("the fast path does not take a simulator quote")
	}
	if _, ok := fastSignature(good.Signature); !ok {
		f.Fatal("the fast path does not take a simulator signature")
	}
	for _, b := range [][]byte{good.Attest, sha1.Attest, good.Signature, {}} {
		f.Add(b)
		f.Add(append(bytes.Clone(b), 0))
		for _, i := range []int{1, 5, 7, 40, 60, len(b) - 1} {
			if i >= 0 && i < len(b) {
				f.Add(b[:i])
				c := bytes.Clone(b)
				c[i] ^= 0x01
				f.Add(c)
			}
		}
	}
	// An ECDSA signature whose R has a size field one short.
	short := bytes.Clone(good.Signature)
	binary.BigEndian.PutUint16(short[4:], binary.BigEndian.Uint16(short[4:])-1)
	f.Add(short)

	f.Fuzz(func(t *testing.T, b []byte) {
		if att, sel, info, ok := fastAttest(b); ok {
			if enc := tpm2.Marshal(*att); !bytes.Equal(enc, b) {
				t.Fatalf("fast attest re-encodes to %x, not %x", enc, b)
			}
			slow, err := tpm2.Unmarshal[tpm2.TPMSAttest](b)
			if err != nil {
				t.Fatalf("fast path took an attest go-tpm refuses: %v", err)
			}
			sinfo, err := slow.Attested.Quote()
			if err != nil || len(sinfo.PCRSelect.PCRSelections) != 1 || !bytes.Equal(tpm2.Marshal(*slow), b) {
				t.Fatalf("fast path took an attest go-tpm's path refuses: %v", err)
			}
			ssel := sinfo.PCRSelect.PCRSelections[0]
			if !bytes.Equal(att.ExtraData.Buffer, slow.ExtraData.Buffer) || sel.Hash != ssel.Hash ||
				!bytes.Equal(sel.PCRSelect, ssel.PCRSelect) || !bytes.Equal(info.PCRDigest.Buffer, sinfo.PCRDigest.Buffer) {
				t.Fatalf("fast attest %+v %+v, go-tpm %+v %+v", att, info, slow, sinfo)
			}
		}
		if sig, ok := fastSignature(b); ok {
			if enc := tpm2.Marshal(*sig); !bytes.Equal(enc, b) {
				t.Fatalf("fast signature re-encodes to %x, not %x", enc, b)
			}
			slow, err := tpm2.Unmarshal[tpm2.TPMTSignature](b)
			if err != nil || !bytes.Equal(tpm2.Marshal(*slow), b) {
				t.Fatalf("fast path took a signature go-tpm's path refuses: %v", err)
			}
			e, _ := sig.Signature.ECDSA()
			se, err := slow.Signature.ECDSA()
			if err != nil || slow.SigAlg != sig.SigAlg || e.Hash != se.Hash ||
				!bytes.Equal(e.SignatureR.Buffer, se.SignatureR.Buffer) || !bytes.Equal(e.SignatureS.Buffer, se.SignatureS.Buffer) {
				t.Fatalf("fast signature %+v, go-tpm %+v (%v)", e, se, err)
			}
		}
	})
}
