package verify

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-tpm-tools/client"
	"github.com/google/go-tpm/legacy/tpm2"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
)

const (
	initrd = attestationv1.Stage_STAGE_INITRD
	ready  = attestationv1.Stage_STAGE_READY
)

func newNonce(tb testing.TB) []byte {
	n := make([]byte, 32)
	if _, err := rand.Read(n); err != nil {
		tb.Fatal(err)
	}
	return n
}

func mustVerify(t *testing.T, q Quote, nonce []byte) *Result {
	t.Helper()
	res, err := Check(q, nonce)
	if err != nil {
		t.Fatalf("Check: %v", err)
	}
	return res
}

// wantRejection asserts a *Rejection whose reason contains want.
func wantRejection(t *testing.T, q Quote, nonce []byte, want string) {
	t.Helper()
	res, err := Check(q, nonce)
	var rej *Rejection
	if !errors.As(err, &rej) {
		t.Fatalf("Check = %v, %v; want a rejection containing %q", res, err, want)
	}
	if res != nil {
		t.Errorf("Check returned a result with rejection %q", rej.Reason)
	}
	if !strings.Contains(rej.Reason, want) {
		t.Fatalf("rejection %q, want it to contain %q", rej.Reason, want)
	}
	t.Logf("rejected: %s", rej.Reason)
	if rej.Error() != rej.Reason {
		t.Errorf("Error() = %q, want the reason", rej.Error())
	}
}

func TestRequiredPCRs(t *testing.T) {
	for stage, want := range map[attestationv1.Stage][]uint32{
		initrd:                                {0, 1, 2, 3, 4, 5, 6, 7, 11},
		ready:                                 {0, 1, 2, 3, 4, 5, 6, 7, 11, 13},
		attestationv1.Stage_STAGE_UNSPECIFIED: nil,
		attestationv1.Stage(7):                nil,
	} {
		if got := RequiredPCRs(stage); !slices.Equal(got, want) {
			t.Errorf("RequiredPCRs(%v) = %v, want %v", stage, got, want)
		}
	}
}

func TestVerified(t *testing.T) {
	f := getFixture(t)
	for _, tc := range []struct {
		name  string
		key   func(testing.TB) *client.Key
		stage attestationv1.Stage
		pcrs  []int
	}{
		{"ecc/initrd", func(testing.TB) *client.Key { return f.ecc }, initrd, initrdPCRs},
		{"ecc/ready", func(testing.TB) *client.Key { return f.ecc }, ready, readyPCRs},
		{"rsa/initrd", f.rsaAK, initrd, initrdPCRs},
		{"rsa/ready", f.rsaAK, ready, readyPCRs},
		// More than required is fine; the result holds the whole selection.
		{"ecc/initrd-superset", func(testing.TB) *client.Key { return f.ecc }, initrd, []int{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 23}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			nonce := newNonce(t)
			q := f.quote(t, tc.key(t), tpm2.AlgSHA256, tc.pcrs, nonce)
			q.Stage = tc.stage
			res := mustVerify(t, q, nonce)

			if !bytes.Equal(res.AKPub, q.AKPub) {
				t.Errorf("AKPub changed: %x, want %x", res.AKPub, q.AKPub)
			}
			sum := sha256.Sum256(q.AKPub)
			if res.AKFingerprint != hex.EncodeToString(sum[:]) {
				t.Errorf("AKFingerprint = %s, want sha256 of the TPMT_PUBLIC", res.AKFingerprint)
			}
			if got := sortedKeys(res.PCRs); !slices.Equal(got, toU32(tc.pcrs)) {
				t.Errorf("PCRs = %v, want exactly %v", got, tc.pcrs)
			}
			for i, v := range res.PCRs {
				if !bytes.Equal(v, q.PCRs[i]) {
					t.Errorf("pcr %d = %x, want %x", i, v, q.PCRs[i])
				}
			}
			if bytes.Equal(res.PCRs[4], make([]byte, 32)) || bytes.Equal(res.PCRs[11], make([]byte, 32)) {
				t.Error("pcrs 4 and 11 should have been extended")
			}
			if res.Events != nil || res.EventLogError != "" {
				t.Errorf("no log given, got events %v, error %q", res.Events, res.EventLogError)
			}
		})
	}
}

func toU32(v []int) []uint32 {
	out := make([]uint32, len(v))
	for i, x := range v {
		out[i] = uint32(x)
	}
	return out
}

func TestRSAPSS(t *testing.T) {
	f := getFixture(t)
	tmpl := client.AKTemplateRSA()
	tmpl.RSAParameters.Sign.Alg = tpm2.AlgRSAPSS
	f.withKey(t, tmpl, func(k *client.Key) {
		nonce := newNonce(t)
		q := f.quote(t, k, tpm2.AlgSHA256, readyPCRs, nonce)
		q.Stage = ready
		mustVerify(t, q, nonce)
	})
}

func TestFingerprintStableAndTPM2BAccepted(t *testing.T) {
	f := getFixture(t)
	n1, n2 := newNonce(t), newNonce(t)
	q1 := f.quote(t, f.ecc, tpm2.AlgSHA256, initrdPCRs, n1)
	q1.Stage = initrd
	q2 := f.quote(t, f.ecc, tpm2.AlgSHA256, readyPCRs, n2)
	q2.Stage = ready
	// The guest may send TPM2B_PUBLIC; the pinned form is the TPMT_PUBLIC.
	q2.AKPub = append(binary.BigEndian.AppendUint16(nil, uint16(len(q2.AKPub))), q2.AKPub...)

	r1, r2 := mustVerify(t, q1, n1), mustVerify(t, q2, n2)
	if r1.AKFingerprint != r2.AKFingerprint {
		t.Errorf("fingerprints differ: %s, %s", r1.AKFingerprint, r2.AKFingerprint)
	}
	if !bytes.Equal(r1.AKPub, r2.AKPub) || !bytes.Equal(r2.AKPub, q1.AKPub) {
		t.Errorf("AKPub not normalized to the TPMT_PUBLIC: %x", r2.AKPub)
	}
	if len(r1.AKFingerprint) != 64 {
		t.Errorf("fingerprint %q is not 64 hex", r1.AKFingerprint)
	}
	if _, err := hex.DecodeString(r1.AKFingerprint); err != nil || strings.ToLower(r1.AKFingerprint) != r1.AKFingerprint {
		t.Errorf("fingerprint %q is not lower-case hex", r1.AKFingerprint)
	}
}

func TestEmptyNonceIsNotARejection(t *testing.T) {
	f := getFixture(t)
	q := f.quote(t, f.ecc, tpm2.AlgSHA256, initrdPCRs, nil)
	q.Stage = initrd
	_, err := Check(q, nil)
	var rej *Rejection
	if err == nil || errors.As(err, &rej) {
		t.Fatalf("Check with an empty nonce = %v, want a plain error", err)
	}
}

// attestPCRSelectOffset is where TPMS_QUOTE_INFO's TPML_PCR_SELECTION starts.
func attestPCRSelectOffset(a []byte) int {
	off := 6
	off += 2 + int(binary.BigEndian.Uint16(a[off:])) // qualifiedSigner
	off += 2 + int(binary.BigEndian.Uint16(a[off:])) // extraData
	return off + 17 + 8                              // clockInfo, firmwareVersion
}

func TestRejections(t *testing.T) {
	f := getFixture(t)
	nonce := newNonce(t)
	good := f.quote(t, f.ecc, tpm2.AlgSHA256, readyPCRs, nonce)
	good.Stage = ready
	mustVerify(t, good, nonce)

	// clone returns a deep copy of good to tamper with.
	clone := func() Quote {
		q := good
		q.AKPub, q.Attest, q.Signature = bytes.Clone(q.AKPub), bytes.Clone(q.Attest), bytes.Clone(q.Signature)
		q.PCRs = map[uint32][]byte{}
		for i, v := range good.PCRs {
			q.PCRs[i] = bytes.Clone(v)
		}
		return q
	}
	sel := attestPCRSelectOffset(good.Attest)

	for _, tc := range []struct {
		name   string
		tamper func(q *Quote)
		nonce  []byte
		want   string
	}{
		{"unspecified stage", func(q *Quote) { q.Stage = attestationv1.Stage_STAGE_UNSPECIFIED }, nil, "unspecified stage"},
		{"unknown stage", func(q *Quote) { q.Stage = 9 }, nil, "unknown stage 9"},
		{"wrong nonce", func(*Quote) {}, newNonce(t), "qualifying data does not match the nonce"},
		{"nonce prefix", func(*Quote) {}, nonce[:16], "qualifying data does not match the nonce"},
		{"tampered clock", func(q *Quote) { q.Attest[sel-10] ^= 1 }, nil, "quote signature does not verify"},
		{"tampered pcr digest", func(q *Quote) { q.Attest[len(q.Attest)-1] ^= 0x80 }, nil, "quote signature does not verify"},
		{"tampered signature", func(q *Quote) { q.Signature[len(q.Signature)-1] ^= 1 }, nil, "quote signature does not verify"},
		{"pcr value changed", func(q *Quote) { q.PCRs[4][0] ^= 1 }, nil, "pcr digest does not match the pcr values"},
		{"pcr values swapped", func(q *Quote) { q.PCRs[0], q.PCRs[1] = q.PCRs[1], q.PCRs[0] }, nil, "pcr digest does not match the pcr values"},
		{"pcr value missing", func(q *Quote) { delete(q.PCRs, 5) }, nil, "pcr 5 is quoted but missing from the pcr values"},
		{"pcr value short", func(q *Quote) { q.PCRs[7] = q.PCRs[7][:20] }, nil, "pcr 7 value is 20 bytes, want 32"},
		{"bad magic", func(q *Quote) { q.Attest[0] = 0 }, nil, "attest magic is 0x00544347, not TPM_GENERATED_VALUE"},
		{"not a quote", func(q *Quote) { q.Attest[5] = 0x17 }, nil, "attest type is 0x8017, not ATTEST_QUOTE"},
		{"attest trailing byte", func(q *Quote) { q.Attest = append(q.Attest, 0) }, nil, "attest is not a canonical TPMS_ATTEST"},
		{"two banks", func(q *Quote) {
			// Count 2, then the sha1 bank with the same bitmap before the sha256 one.
			first := q.Attest[sel+4 : sel+4+6]
			extra := append([]byte{0x00, 0x04}, first[2:]...)
			a := append(bytes.Clone(q.Attest[:sel]), 0, 0, 0, 2)
			a = append(a, extra...)
			q.Attest = append(a, q.Attest[sel+4:]...)
		}, nil, "quote selects 2 pcr banks, want exactly one"},
		{"no bank", func(q *Quote) {
			a := append(bytes.Clone(q.Attest[:sel]), 0, 0, 0, 0)
			q.Attest = append(a, q.Attest[sel+4+6:]...)
		}, nil, "quote selects 0 pcr banks, want exactly one"},
		{"ak trailing byte", func(q *Quote) { q.AKPub = append(q.AKPub, 0) }, nil, "ak public area is not a canonical TPMT_PUBLIC"},
		{"ak bad TPM2B size", func(q *Quote) {
			q.AKPub = append(binary.BigEndian.AppendUint16(nil, uint16(len(q.AKPub)+1)), q.AKPub...)
		}, nil, "ak"},
		{"signature trailing byte", func(q *Quote) { q.Signature = append(q.Signature, 0) }, nil, "signature is not a canonical TPMT_SIGNATURE"},
		{"signature hash", func(q *Quote) { q.Signature[3] = 0x04 }, nil, "signature hash sha1 does not suit the ak, whose scheme signs with sha256"},
		{"signature scheme", func(q *Quote) { q.Signature[1] = 0x14 }, nil, "signature scheme rsassa does not match the ak scheme ecdsa"},
		{"empty attest", func(q *Quote) { q.Attest = nil }, nil, "attest is 0 bytes, too short"},
		{"empty ak", func(q *Quote) { q.AKPub = nil }, nil, "ak public area does not parse"},
		{"empty signature", func(q *Quote) { q.Signature = nil }, nil, "signature does not parse"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := clone()
			tc.tamper(&q)
			n := nonce
			if tc.nonce != nil {
				n = tc.nonce
			}
			wantRejection(t, q, n, tc.want)
		})
	}
}

func TestCoverage(t *testing.T) {
	f := getFixture(t)
	nonce := newNonce(t)
	q := f.quote(t, f.ecc, tpm2.AlgSHA256, initrdPCRs, nonce)
	q.Stage = ready
	wantRejection(t, q, nonce, "quote does not cover pcr 13, required at the ready stage")

	nonce = newNonce(t)
	q = f.quote(t, f.ecc, tpm2.AlgSHA256, []int{0, 1, 2, 3, 4, 5, 6}, nonce)
	q.Stage = initrd
	wantRejection(t, q, nonce, "quote does not cover pcrs 7, 11, required at the initrd stage")
}

func TestSHA1Bank(t *testing.T) {
	f := getFixture(t)
	nonce := newNonce(t)
	q := f.quote(t, f.ecc, tpm2.AlgSHA1, readyPCRs, nonce)
	q.Stage = ready
	wantRejection(t, q, nonce, "quote is over the sha1 pcr bank, want sha256")
}

func TestUnsuitableAK(t *testing.T) {
	f := getFixture(t)

	t.Run("not restricted", func(t *testing.T) {
		tmpl := client.AKTemplateECC()
		tmpl.Attributes &^= tpm2.FlagRestricted
		f.withKey(t, tmpl, func(k *client.Key) {
			nonce := newNonce(t)
			q := f.quote(t, k, tpm2.AlgSHA256, readyPCRs, nonce)
			q.Stage = ready
			wantRejection(t, q, nonce, "ak is unsuitable: not restricted (an ak must be")
		})
	})

	t.Run("storage key", func(t *testing.T) {
		// A guest that sends its SRK: restricted, decrypt, not sign.
		nonce := newNonce(t)
		q := f.quote(t, f.ecc, tpm2.AlgSHA256, readyPCRs, nonce)
		q.Stage = ready
		f.withKey(t, client.SRKTemplateECC(), func(k *client.Key) {
			pub, err := k.PublicArea().Encode()
			if err != nil {
				t.Fatal(err)
			}
			q.AKPub = pub
		})
		wantRejection(t, q, nonce, "ak is unsuitable: not sign, can decrypt")
	})

	t.Run("sign and decrypt", func(t *testing.T) {
		tmpl := client.AKTemplateECC()
		tmpl.Attributes = tmpl.Attributes&^tpm2.FlagRestricted | tpm2.FlagDecrypt
		tmpl.ECCParameters.Sign = nil
		f.withKey(t, tmpl, func(k *client.Key) {
			nonce := newNonce(t)
			q := f.quote(t, f.ecc, tpm2.AlgSHA256, readyPCRs, nonce)
			q.Stage = ready
			if q.AKPub, _ = k.PublicArea().Encode(); q.AKPub == nil {
				t.Fatal("no public area")
			}
			wantRejection(t, q, nonce, "not restricted, can decrypt")
		})
	})

	t.Run("p-384", func(t *testing.T) {
		tmpl := client.AKTemplateECC()
		tmpl.ECCParameters.CurveID = tpm2.CurveNISTP384
		tmpl.ECCParameters.Sign.Hash = tpm2.AlgSHA384
		tmpl.ECCParameters.Point.XRaw = make([]byte, 48)
		tmpl.ECCParameters.Point.YRaw = make([]byte, 48)
		f.withKey(t, tmpl, func(k *client.Key) {
			nonce := newNonce(t)
			q := f.quote(t, k, tpm2.AlgSHA256, readyPCRs, nonce)
			q.Stage = ready
			wantRejection(t, q, nonce, "ak curve 0x0004 is not nist p-256")
		})
	})

	t.Run("another ak", func(t *testing.T) {
		// A well-formed AK that did not sign this quote.
		nonce := newNonce(t)
		q := f.quote(t, f.ecc, tpm2.AlgSHA256, readyPCRs, nonce)
		q.Stage = ready
		simMu.Lock()
		k, err := client.NewKey(f.sim, tpm2.HandleEndorsement, client.AKTemplateECC())
		simMu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		q.AKPub, _ = k.PublicArea().Encode()
		k.Close()
		wantRejection(t, q, nonce, "quote signature does not verify")
	})

	t.Run("rsa signature for ecc ak", func(t *testing.T) {
		nonce := newNonce(t)
		q := f.quote(t, f.rsaAK(t), tpm2.AlgSHA256, readyPCRs, nonce)
		q.Stage = ready
		q.AKPub, _ = f.ecc.PublicArea().Encode()
		wantRejection(t, q, nonce, "signature scheme rsassa does not match the ak scheme ecdsa")
	})

	t.Run("ecc ak bits", func(t *testing.T) {
		nonce := newNonce(t)
		q := f.quote(t, f.ecc, tpm2.AlgSHA256, readyPCRs, nonce)
		q.Stage = ready
		pub := f.ecc.PublicArea()
		pub.Attributes &^= tpm2.FlagFixedTPM | tpm2.FlagSensitiveDataOrigin
		q.AKPub, _ = pub.Encode()
		wantRejection(t, q, nonce, "ak is unsuitable: not fixedTPM, not sensitiveDataOrigin")
	})

	t.Run("ecc point off curve", func(t *testing.T) {
		nonce := newNonce(t)
		q := f.quote(t, f.ecc, tpm2.AlgSHA256, readyPCRs, nonce)
		q.Stage = ready
		pub := f.ecc.PublicArea()
		params := *pub.ECCParameters // shared with the key: copy before changing
		pub.ECCParameters = &params
		pub.ECCParameters.Point.YRaw = bytes.Clone(pub.ECCParameters.Point.YRaw)
		pub.ECCParameters.Point.YRaw[31] ^= 1
		q.AKPub, _ = pub.Encode()
		wantRejection(t, q, nonce, "ak ecc point is not on nist p-256")
	})
}

// Every truncation and some garbage must be a rejection, never a panic or a
// verified quote.
func TestTruncatedAndGarbage(t *testing.T) {
	f := getFixture(t)
	nonce := newNonce(t)
	good := f.quote(t, f.ecc, tpm2.AlgSHA256, readyPCRs, nonce)
	good.Stage = ready
	check := func(name string, q Quote) {
		t.Helper()
		_, err := Check(q, nonce)
		var rej *Rejection
		if !errors.As(err, &rej) {
			t.Errorf("%s: Check = %v, want a rejection", name, err)
		}
	}
	for n := range len(good.Attest) {
		q := good
		q.Attest = good.Attest[:n]
		check("attest truncated", q)
	}
	for n := range len(good.AKPub) {
		q := good
		q.AKPub = good.AKPub[:n]
		check("ak truncated", q)
	}
	for n := range len(good.Signature) {
		q := good
		q.Signature = good.Signature[:n]
		check("signature truncated", q)
	}
	for range 200 {
		g := make([]byte, 1+len(good.Attest))
		rand.Read(g)
		q := good
		q.Attest = g
		check("garbage attest", q)
		q = good
		q.AKPub = g
		check("garbage ak", q)
		q = good
		q.Signature = g
		check("garbage signature", q)
		q = good
		copy(g, good.Attest[:6]) // past the magic and type
		q.Attest = g
		check("garbage quote body", q)
	}
}

func BenchmarkCheck(b *testing.B) {
	f := getFixture(b)
	nonce := newNonce(b)
	q := f.quote(b, f.ecc, tpm2.AlgSHA256, readyPCRs, nonce)
	q.Stage = ready
	if _, err := Check(q, nonce); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	n := 0
	for b.Loop() {
		if _, err := Check(q, nonce); err != nil {
			b.Fatal(err)
		}
		n++
	}
	b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "quotes/s")
}
