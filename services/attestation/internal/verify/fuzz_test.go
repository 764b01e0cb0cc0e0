package verify

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"slices"
	"testing"

	"github.com/google/go-eventlog/register"
	"github.com/google/go-eventlog/tcg"
	"github.com/google/go-tpm/legacy/tpm2"

	"github.com/giantswarm/vm-manager/pkg/measure"
)

// fuzzNonce is fixed so the seeds mean the same in every fuzz worker.
var fuzzNonce = bytes.Repeat([]byte{0x5a}, 32)

// FuzzCheck feeds hostile attest, signature, AK and userspace log bytes to
// Check. The seeds are one real UKI-boot quote with its logs from the
// simulator (made once per process, outside the fuzz loop) and corrupted
// variants of it.
func FuzzCheck(f *testing.F) {
	fx := getFixture(f)
	good := fx.quote(f, fx.ecc, tpm2.AlgSHA256, readyPCRs, fuzzNonce)
	good.Stage = ready
	good.EventLog, good.UserspaceLog = fx.ukiLog, fx.userLog
	if res, err := Check(good, fuzzNonce); err != nil || res.EventLogError != "" {
		f.Fatal(err, res)
	}

	flip := func(b []byte, i int) []byte {
		c := bytes.Clone(b)
		c[i%len(c)] ^= 0xff
		return c
	}
	ulog := good.UserspaceLog
	tpm2b := append(binary.BigEndian.AppendUint16(nil, uint16(len(good.AKPub))), good.AKPub...)
	f.Add(good.Attest, good.Signature, good.AKPub, ulog)
	f.Add(good.Attest, good.Signature, tpm2b, ulog)
	f.Add(good.Attest[:len(good.Attest)/2], good.Signature, good.AKPub, ulog)
	f.Add(good.Attest, good.Signature[:len(good.Signature)-1], good.AKPub, ulog)
	f.Add(good.Attest, good.Signature, good.AKPub[:40], ulog)
	f.Add(flip(good.Attest, 7), good.Signature, good.AKPub, ulog)
	f.Add(flip(good.Attest, len(good.Attest)-1), good.Signature, good.AKPub, ulog)
	f.Add(good.Attest, flip(good.Signature, 1), good.AKPub, ulog)
	f.Add(good.Attest, good.Signature, flip(good.AKPub, 9), ulog)
	f.Add(append(bytes.Clone(good.Attest), 0), good.Signature, good.AKPub, ulog)
	f.Add([]byte{}, []byte{}, []byte{}, ulog)
	f.Add(good.Attest, good.Signature, good.AKPub, []byte{})
	f.Add(good.Attest, good.Signature, good.AKPub, ulog[:len(ulog)/2])
	f.Add(good.Attest, good.Signature, good.AKPub, flip(ulog, 60))
	f.Add(good.Attest, good.Signature, good.AKPub, append(bytes.Clone(ulog), userLog(word{11, "leave-initrd", "phase"})...))

	f.Fuzz(func(t *testing.T, attest, sig, akPub, ulog []byte) {
		q := good
		q.Attest, q.Signature, q.AKPub, q.UserspaceLog = attest, sig, akPub, ulog
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
		if len(res.PCRs) != len(readyPCRs) || bytes.Equal(ulog, good.UserspaceLog) && res.EventLogError != "" {
			t.Fatalf("verified result %+v", res)
		}
		checkEventsReplay(t, res.Events, res.PCRs)
	})
}

// fuzzPCRs are the PCRs the fixture's logs replay to, computed without the
// simulator: bootEvents and ukiEvents, then fixtureWords. PCR 8 is left
// out, so its events are not checked.
func fuzzPCRs() map[uint32][]byte {
	pcrs := map[uint32][]byte{}
	for _, i := range []uint32{0, 1, 2, 3, 4, 5, 6, 7, 11, 13} {
		pcrs[i] = measure.Zero()
	}
	for _, e := range slices.Concat(bootEvents, ukiEvents()) {
		if v, ok := pcrs[e.pcr]; ok {
			pcrs[e.pcr] = measure.Extend(v, measure.Digest(e.measured()))
		}
	}
	for _, w := range fixtureWords() {
		pcrs[w.pcr] = measure.Extend(pcrs[w.pcr], measure.Digest([]byte(w.word)))
	}
	return pcrs
}

// FuzzEventLog feeds hostile firmware and userspace logs to the replay, and
// every parsed event's data to describe. Whatever it returns must replay to
// the PCRs. Seeds are built in Go; no simulator.
func FuzzEventLog(f *testing.F) {
	// Small seeds: the fuzzer minimizes what it finds, at a cost that
	// grows with the input. PCRs 0–7 without events are not checked.
	uki := buildLog(ukiEvents(), sha256Alg)
	words := fixtureWords()
	f.Add(uki, userLog(words...))
	f.Add(uki, []byte{})
	f.Add(buildLog(bootEvents[:3], sha256Alg), userLog(words[1:]...))
	f.Add(buildLog(bootEvents[13:], sha1Alg), userLog(words...))
	f.Add([]byte{}, userLog(words...))
	f.Add([]byte{}, []byte("\x1e{\"pcr\":13,\"digests\":[{\"hashAlg\":\"sha256\",\"digest\":\"00\"}]}\n"))
	f.Add([]byte{}, []byte{})
	pcrs := fuzzPCRs()
	f.Fuzz(func(t *testing.T, log, ulog []byte) {
		evs, _ := replayLogs(log, ulog, pcrs)
		checkEventsReplay(t, evs, pcrs)
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
