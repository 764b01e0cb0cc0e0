package attest

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"

	"github.com/google/go-tpm/tpm2"
)

// fakeIMDS serves nonces and checks quotes the way the host's verifier does
// (contract §5.4 steps 1–10), independently of the guest code.
type fakeIMDS struct {
	*httptest.Server

	mu        sync.Mutex
	nonces    map[string]bool // issued and unused
	failPosts int             // answer this many POSTs with 500 first
	policy    func(stage string, pcrs map[uint][]byte) error
	posts     int
	gets      int
	requests  []Request // the ones that verified
}

func newFakeIMDS(t *testing.T) *fakeIMDS {
	f := &fakeIMDS{nonces: map[string]bool{}}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /attest/nonce", f.nonce)
	mux.HandleFunc("POST /attest/quote", f.quote)
	f.Server = httptest.NewServer(mux)
	t.Cleanup(f.Close)
	return f
}

func (f *fakeIMDS) nonce(w http.ResponseWriter, _ *http.Request) {
	b := make([]byte, 32)
	rand.Read(b)
	n := hex.EncodeToString(b)
	f.mu.Lock()
	f.nonces[n] = true
	f.gets++
	f.mu.Unlock()
	w.Write([]byte(n))
}

func (f *fakeIMDS) quote(w http.ResponseWriter, r *http.Request) {
	var req Request
	if err := json.NewDecoder(r.Body).Decode(&req); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	if (req.Stage != StageInitrd && req.Stage != StageReady) || req.Nonce == "" ||
		req.AKPub == nil || req.Quote == nil || req.Signature == nil || req.PCRs == nil {
		http.Error(w, "incomplete request", http.StatusBadRequest)
		return
	}
	f.mu.Lock()
	f.posts++
	issued := f.nonces[req.Nonce]
	delete(f.nonces, req.Nonce) // single use, even when it fails
	fail := f.posts <= f.failPosts
	f.mu.Unlock()
	if fail {
		http.Error(w, "attestor unavailable", http.StatusInternalServerError)
		return
	}
	reply := func(code int, res Response) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		json.NewEncoder(w).Encode(res)
	}
	if !issued {
		reply(http.StatusForbidden, Response{Stage: req.Stage, Message: "unknown or expired nonce"})
		return
	}
	nonce, _ := hex.DecodeString(req.Nonce)
	fp, pcrs, err := verifyRequest(req, nonce)
	if err == nil && f.policy != nil {
		err = f.policy(req.Stage, pcrs)
	}
	if err != nil {
		reply(http.StatusForbidden, Response{Stage: req.Stage, Message: err.Error()})
		return
	}
	f.mu.Lock()
	f.requests = append(f.requests, req)
	f.mu.Unlock()
	reply(http.StatusOK, Response{Stage: req.Stage, Verified: true, UserDataReleased: req.Stage == StageInitrd,
		Message: fmt.Sprintf("verified: ak %s, stage %s", fp, req.Stage)})
}

func (f *fakeIMDS) verified() []Request {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]Request(nil), f.requests...)
}

// verifyRequest checks a quote request against nonce and returns the AK
// fingerprint (16 hex of sha256(TPMT_PUBLIC)) and the quoted PCR values.
func verifyRequest(req Request, nonce []byte) (string, map[uint][]byte, error) {
	ak, err := tpm2.Unmarshal[tpm2.TPMTPublic](req.AKPub)
	if err != nil {
		return "", nil, fmt.Errorf("ak_pub: %w", err)
	}
	a := ak.ObjectAttributes
	if !a.FixedTPM || !a.FixedParent || !a.SensitiveDataOrigin || !a.Restricted || !a.SignEncrypt || a.Decrypt {
		return "", nil, errors.New("ak_pub: not a restricted fixedTPM signing key")
	}
	if ak.Type != tpm2.TPMAlgECC {
		return "", nil, errors.New("ak_pub: not ECC")
	}
	pub, err := tpm2.Pub(*ak)
	if err != nil {
		return "", nil, fmt.Errorf("ak_pub: %w", err)
	}
	key, ok := pub.(*ecdsa.PublicKey)
	if !ok || key.Curve != elliptic.P256() {
		return "", nil, errors.New("ak_pub: not P-256")
	}

	sig, err := tpm2.Unmarshal[tpm2.TPMTSignature](req.Signature)
	if err != nil {
		return "", nil, fmt.Errorf("signature: %w", err)
	}
	if sig.SigAlg != tpm2.TPMAlgECDSA {
		return "", nil, fmt.Errorf("signature: algorithm %#x, want ECDSA", uint16(sig.SigAlg))
	}
	es, err := sig.Signature.ECDSA()
	if err != nil || es.Hash != tpm2.TPMAlgSHA256 {
		return "", nil, errors.New("signature: not ECDSA-SHA256")
	}
	digest := sha256.Sum256(req.Quote)
	r, s := new(big.Int).SetBytes(es.SignatureR.Buffer), new(big.Int).SetBytes(es.SignatureS.Buffer)
	if !ecdsa.Verify(key, digest[:], r, s) {
		return "", nil, errors.New("signature does not verify with ak_pub")
	}

	att, err := tpm2.Unmarshal[tpm2.TPMSAttest](req.Quote) // also checks TPM_GENERATED_VALUE
	if err != nil {
		return "", nil, fmt.Errorf("quote: %w", err)
	}
	if att.Type != tpm2.TPMSTAttestQuote {
		return "", nil, errors.New("quote: not TPM_ST_ATTEST_QUOTE")
	}
	if subtle.ConstantTimeCompare(att.ExtraData.Buffer, nonce) != 1 {
		return "", nil, errors.New("quote: qualifying data is not the nonce")
	}
	info, err := att.Attested.Quote()
	if err != nil {
		return "", nil, fmt.Errorf("quote: %w", err)
	}
	if len(info.PCRSelect.PCRSelections) != 1 || info.PCRSelect.PCRSelections[0].Hash != tpm2.TPMAlgSHA256 {
		return "", nil, errors.New("quote: want exactly the sha256 bank")
	}
	bitmap := info.PCRSelect.PCRSelections[0].PCRSelect
	values := map[uint][]byte{}
	h := sha256.New()
	for i := range uint(len(bitmap) * 8) { // ascending index order
		if bitmap[i/8]&(1<<(i%8)) == 0 {
			continue
		}
		v, err := hex.DecodeString(req.PCRs["sha256"][strconv.Itoa(int(i))])
		if err != nil || len(v) != sha256.Size {
			return "", nil, fmt.Errorf("pcrs: sha256 PCR %d missing or not a digest", i)
		}
		values[i] = v
		h.Write(v)
	}
	if !bytes.Equal(h.Sum(nil), info.PCRDigest.Buffer) {
		return "", nil, errors.New("pcrs: values do not match the quote's pcrDigest")
	}
	// The contract's list, not the guest's StagePCRs, so a change there shows.
	want := map[string][]uint{"initrd": {0, 1, 2, 3, 4, 5, 6, 7, 11}, "ready": {0, 1, 2, 3, 4, 5, 6, 7, 11, 13}}[req.Stage]
	if want == nil {
		return "", nil, fmt.Errorf("unknown stage %q", req.Stage)
	}
	for _, i := range want {
		if _, ok := values[i]; !ok {
			return "", nil, fmt.Errorf("quote does not cover PCR %d required at stage %s", i, req.Stage)
		}
	}
	fp := sha256.Sum256(req.AKPub)
	return hex.EncodeToString(fp[:8]), values, nil
}
