package verify

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"testing"

	"github.com/google/go-eventlog/register"
	"github.com/google/go-eventlog/tcg"
	"github.com/google/go-tpm/legacy/tpm2"
)

// fuzzNonce is fixed so the seeds mean the same in every fuzz worker.
var fuzzNonce = bytes.Repeat([]byte{0x5a}, 32)

// FuzzCheck feeds hostile attest, signature and AK bytes to Check. The seeds
// are one real quote from the simulator (made once per process, outside the
// fuzz loop) and corrupted variants of it.
func FuzzCheck(f *testing.F) {
	fx := getFixture(f)
	good := fx.quote(f, fx.ecc, tpm2.AlgSHA256, readyPCRs, fuzzNonce)
	good.Stage = ready
	good.EventLog = fx.log
	if _, err := Check(good, fuzzNonce); err != nil {
		f.Fatal(err)
	}

	flip := func(b []byte, i int) []byte {
		c := bytes.Clone(b)
		c[i%len(c)] ^= 0xff
		return c
	}
	tpm2b := append(binary.BigEndian.AppendUint16(nil, uint16(len(good.AKPub))), good.AKPub...)
	f.Add(good.Attest, good.Signature, good.AKPub)
	f.Add(good.Attest, good.Signature, tpm2b)
	f.Add(good.Attest[:len(good.Attest)/2], good.Signature, good.AKPub)
	f.Add(good.Attest, good.Signature[:len(good.Signature)-1], good.AKPub)
	f.Add(good.Attest, good.Signature, good.AKPub[:40])
	f.Add(flip(good.Attest, 7), good.Signature, good.AKPub)
	f.Add(flip(good.Attest, len(good.Attest)-1), good.Signature, good.AKPub)
	f.Add(good.Attest, flip(good.Signature, 1), good.AKPub)
	f.Add(good.Attest, good.Signature, flip(good.AKPub, 9))
	f.Add(append(bytes.Clone(good.Attest), 0), good.Signature, good.AKPub)
	f.Add([]byte{}, []byte{}, []byte{})

	f.Fuzz(func(t *testing.T, attest, sig, akPub []byte) {
		q := good
		q.Attest, q.Signature, q.AKPub = attest, sig, akPub
		res, err := Check(q, fuzzNonce)
		if err != nil {
			var rej *Rejection
			if !errors.As(err, &rej) || rej.Reason == "" {
				t.Fatalf("Check error %v is not a rejection with a reason", err)
			}
			return
		}
		// Any attest this AK signed over these PCRs may verify (every fuzz
		// worker makes its own seed quote); the result must be consistent.
		if sum := sha256.Sum256(res.AKPub); res.AKFingerprint != hex.EncodeToString(sum[:]) {
			t.Fatalf("fingerprint %s is not the sha256 of %x", res.AKFingerprint, res.AKPub)
		}
		if !bytes.Equal(res.AKPub, akPub) && (len(akPub) < 2 || !bytes.Equal(res.AKPub, akPub[2:])) {
			t.Fatalf("AKPub %x is not the given %x", res.AKPub, akPub)
		}
		for i, v := range res.PCRs {
			if !bytes.Equal(v, good.PCRs[i]) {
				t.Fatalf("pcr %d = %x, not the given value", i, v)
			}
		}
		if len(res.PCRs) != len(readyPCRs) || res.EventLogError != "" {
			t.Fatalf("verified result %+v", res)
		}
	})
}

// FuzzEventLog feeds hostile logs to the replay and every parsed event's
// data to describe. Seeds are built in Go; no simulator.
func FuzzEventLog(f *testing.F) {
	f.Add(buildLog(bootEvents, sha1Alg, sha256Alg))
	f.Add(buildLog(bootEvents[:3], sha256Alg))
	f.Add(buildLog(bootEvents, sha1Alg))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, log []byte) {
		pcrs := map[uint32][]byte{}
		for i := range uint32(8) {
			pcrs[i] = make([]byte, 32)
		}
		replayLog(log, pcrs)
		el, err := tcg.ParseEventLog(log, tcg.ParseOpts{AllowPadding: true})
		if err != nil {
			return
		}
		for _, e := range el.Events(register.HashSHA256) {
			describe(e.Type, e.Data)
		}
	})
}

// FuzzDescribe feeds hostile event data to each decoder.
func FuzzDescribe(f *testing.F) {
	for _, e := range bootEvents {
		f.Add(e.typ, e.data)
	}
	f.Add(uint32(tcg.EFIHandoffTables), append(le64(3), make([]byte, 40)...))
	f.Fuzz(func(t *testing.T, typ uint32, data []byte) {
		s := describe(tcg.EventType(typ), data)
		if len([]rune(s)) > maxDesc+1 {
			t.Fatalf("description of %d runes", len([]rune(s)))
		}
	})
}
