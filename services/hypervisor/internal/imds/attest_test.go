package imds

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strconv"
	"strings"
	"testing"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
)

func TestNonce(t *testing.T) {
	f := newFake()
	h := New(f, nil, nil)
	w := get(t, h, ipFull, "/attest/nonce")
	if w.Code != 200 || len(w.Body.String()) != 64 {
		t.Fatalf("got %d %q", w.Code, w.Body.String())
	}
	if _, err := hex.DecodeString(w.Body.String()); err != nil {
		t.Fatal(err)
	}
	expect(t, w, 200, strings.Repeat("ab", 32))

	f.nonceErr = errors.New("attestor down")
	expect(t, get(t, h, ipFull, "/attest/nonce"), 500, AttestationUnavailable)
}

// quoteBody is a well-formed quote request with edits applied (nil value deletes).
func quoteBody(edit map[string]any) []byte {
	b64 := base64.StdEncoding.EncodeToString
	m := map[string]any{
		"stage":         "initrd",
		"nonce":         strings.Repeat("ab", 32),
		"ak_pub":        b64([]byte("ak")),
		"ek_pub":        b64([]byte("ek")),
		"quote":         b64([]byte("quote")),
		"signature":     b64([]byte("sig")),
		"pcrs":          map[string]any{"sha256": map[string]string{"0": strings.Repeat("00", 32), "7": strings.Repeat("11", 32)}},
		"event_log":     b64([]byte("log")),
		"userspace_log": b64([]byte("ulog")),
	}
	for k, v := range edit {
		if v == nil {
			delete(m, k)
		} else {
			m[k] = v
		}
	}
	b, err := json.Marshal(m)
	if err != nil {
		panic(err)
	}
	return b
}

func expectQuote(t *testing.T, w *httptest.ResponseRecorder, status int, want QuoteResponse) {
	t.Helper()
	var got QuoteResponse
	if err := json.Unmarshal(w.Body.Bytes(), &got); err != nil {
		t.Fatalf("%d %q: %v", w.Code, w.Body.String(), err)
	}
	if w.Code != status || got != want {
		t.Fatalf("got %d %+v, want %d %+v", w.Code, got, status, want)
	}
	if ct := w.Header().Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q", ct)
	}
	if cl := w.Header().Get("Content-Length"); cl != strconv.Itoa(w.Body.Len()) {
		t.Errorf("Content-Length %q", cl)
	}
	for _, k := range []string{"stage", "verified", "user_data_released"} {
		if !strings.Contains(w.Body.String(), `"`+k+`"`) {
			t.Errorf("response lacks %s: %s", k, w.Body.String())
		}
	}
}

func TestQuoteForwarded(t *testing.T) {
	f := newFake()
	h := New(f, nil, nil)
	expectQuote(t, do(t, h, ipFull, "POST", BasePath+"/attest/quote", quoteBody(map[string]any{"stage": "ready"})), 200,
		QuoteResponse{Stage: "ready", Verified: true})
	if len(f.quotes) != 1 {
		t.Fatalf("%d quotes", len(f.quotes))
	}
	q := f.quotes[0]
	if q.VmId != "0a1b2c3d" || q.Stage != attestationv1.Stage_STAGE_READY || !bytes.Equal(q.Nonce, bytes.Repeat([]byte{0xab}, 32)) ||
		string(q.AkPub) != "ak" || string(q.EkPub) != "ek" || string(q.Quote) != "quote" || string(q.Signature) != "sig" ||
		string(q.EventLog) != "log" || string(q.UserspaceLog) != "ulog" || len(q.Pcrs) != 2 || !bytes.Equal(q.Pcrs[7], bytes.Repeat([]byte{0x11}, 32)) {
		t.Fatalf("forwarded %v", q)
	}
	// Optional fields may be absent.
	expectQuote(t, do(t, h, ipFull, "POST", BasePath+"/attest/quote",
		quoteBody(map[string]any{"ek_pub": nil, "event_log": nil, "userspace_log": nil})), 200,
		QuoteResponse{Stage: "initrd", Verified: true, UserDataReleased: true})
}

func TestQuoteRejected(t *testing.T) {
	f := newFake()
	f.verified = false
	h := New(f, nil, nil)
	expectQuote(t, do(t, h, ipFull, "POST", BasePath+"/attest/quote", quoteBody(nil)), 403,
		QuoteResponse{Stage: "initrd", Message: "pcr 7 mismatch"})
	expect(t, get(t, h, ipFull, "/user-data"), 503, UserDataGated)
}

func TestQuoteBadRequest(t *testing.T) {
	f := newFake()
	h := New(f, nil, nil)
	for name, edit := range map[string]map[string]any{
		"stage missing":         {"stage": nil},
		"stage invalid":         {"stage": "boot"},
		"stage wrong case":      {"stage": "INITRD"},
		"nonce missing":         {"nonce": nil},
		"nonce empty":           {"nonce": ""},
		"nonce not hex":         {"nonce": "zz"},
		"nonce odd":             {"nonce": "abc"},
		"ak_pub missing":        {"ak_pub": nil},
		"ak_pub empty":          {"ak_pub": ""},
		"ak_pub not base64":     {"ak_pub": "!!!"},
		"quote missing":         {"quote": nil},
		"quote not base64":      {"quote": "%%%"},
		"signature missing":     {"signature": nil},
		"signature not base64":  {"signature": "a"},
		"ek_pub not base64":     {"ek_pub": "@"},
		"event_log not base64":  {"event_log": "@"},
		"userspace not base64":  {"userspace_log": "@"},
		"pcrs missing":          {"pcrs": nil},
		"pcrs empty":            {"pcrs": map[string]any{}},
		"pcrs no sha256":        {"pcrs": map[string]any{"sha1": map[string]string{"0": "00"}}},
		"pcrs sha256 empty":     {"pcrs": map[string]any{"sha256": map[string]string{}}},
		"pcrs not an object":    {"pcrs": "sha256"},
		"pcrs bank not object":  {"pcrs": map[string]any{"sha256": []string{"00"}}},
		"pcrs index not number": {"pcrs": map[string]any{"sha256": map[string]string{"x": "00"}}},
		"pcrs index negative":   {"pcrs": map[string]any{"sha256": map[string]string{"-1": "00"}}},
		"pcrs index huge":       {"pcrs": map[string]any{"sha256": map[string]string{"4294967296": "00"}}},
		"pcrs value not hex":    {"pcrs": map[string]any{"sha256": map[string]string{"0": "zz"}}},
		"pcrs value empty":      {"pcrs": map[string]any{"sha256": map[string]string{"0": ""}}},
		"pcrs value number":     {"pcrs": map[string]any{"sha256": map[string]int{"0": 1}}},
	} {
		t.Run(name, func(t *testing.T) {
			w := do(t, h, ipFull, "POST", BasePath+"/attest/quote", quoteBody(edit))
			if w.Code != 400 {
				t.Fatalf("got %d %s", w.Code, w.Body.String())
			}
			var res QuoteResponse
			if err := json.Unmarshal(w.Body.Bytes(), &res); err != nil || res.Verified || res.Message == "" {
				t.Fatalf("body %s (%v)", w.Body.String(), err)
			}
		})
	}
	for name, body := range map[string]string{
		"not json":      "stage=initrd",
		"empty":         "",
		"array":         "[]",
		"trailing data": string(quoteBody(nil)) + "{}",
	} {
		t.Run(name, func(t *testing.T) {
			if w := do(t, h, ipFull, "POST", BasePath+"/attest/quote", []byte(body)); w.Code != 400 {
				t.Fatalf("got %d %s", w.Code, w.Body.String())
			}
		})
	}
	if len(f.quotes) != 0 {
		t.Fatalf("%d malformed quotes reached the attestor", len(f.quotes))
	}
}

func TestQuoteErrorMapping(t *testing.T) {
	for _, tc := range []struct {
		err    error
		status int
		msg    string
	}{
		{apierr.Errorf(apierr.InvalidRequest, "bad ak"), 400, "bad ak"},
		{apierr.Errorf(apierr.NotFound, "vm gone"), 404, "vm gone"},
		{fmt.Errorf("wrapped: %w", apierr.ErrNotFound), 404, "wrapped: not_found"},
		{apierr.Errorf(apierr.Conflict, "vm not booting"), 409, "vm not booting"},
		{apierr.Errorf(apierr.Internal, "secret detail"), 500, AttestationUnavailable},
		{apierr.Errorf(apierr.Unavailable, "secret detail"), 500, AttestationUnavailable},
		// Not REST's 403, 504 and 401: contract §5.2 knows 400, 404, 409 and 500.
		{apierr.Errorf(apierr.Forbidden, "secret detail"), 500, AttestationUnavailable},
		{apierr.Errorf(apierr.Timeout, "secret detail"), 500, AttestationUnavailable},
		{apierr.Errorf(apierr.Unauthenticated, "secret detail"), 500, AttestationUnavailable},
		{errors.New("secret detail"), 500, AttestationUnavailable},
	} {
		f := newFake()
		f.quoteErr = tc.err
		h := New(f, nil, nil)
		expectQuote(t, do(t, h, ipFull, "POST", BasePath+"/attest/quote", quoteBody(nil)), tc.status,
			QuoteResponse{Stage: "initrd", Message: tc.msg})
	}
}

// padded is valid JSON of exactly n bytes.
func padded(prefix string, n int) []byte {
	b := []byte(prefix + strings.Repeat(" ", n-len(prefix)))
	return b
}

func TestBodyLimits(t *testing.T) {
	f := newFake()
	g := NewGuard(Limits{MaxQuoteBytes: 64 << 10, MaxReportBytes: 32 << 10})
	h := New(f, g, nil)
	chunked := func(r *http.Request) { r.ContentLength = -1 }

	if w := do(t, h, ipFull, "POST", BasePath+"/attest/quote", padded(string(quoteBody(nil)), 64<<10)); w.Code != 200 {
		t.Fatalf("quote at the limit: %d %s", w.Code, w.Body.String())
	}
	for _, c := range []struct {
		what string
		body []byte
		edit func(*http.Request)
	}{
		{"one byte over, with Content-Length", padded(string(quoteBody(nil)), 64<<10+1), nil},
		{"one byte over, chunked", padded(string(quoteBody(nil)), 64<<10+1), chunked},
		// A huge base64 field is cut at the limit, not buffered.
		{"a 9.3 MiB event log, chunked", quoteBody(map[string]any{"event_log": base64.StdEncoding.EncodeToString(make([]byte, 7<<20))}), chunked},
		{"valid JSON then a tail over the limit, chunked", append(quoteBody(nil), bytes.Repeat([]byte(" "), 64<<10)...), chunked},
	} {
		w := doWith(t, h, ipFull, "POST", BasePath+"/attest/quote", c.body, c.edit)
		if w.Code != http.StatusRequestEntityTooLarge || !strings.Contains(w.Body.String(), `"message":"quote body is larger than 65536 bytes"`) {
			t.Errorf("quote %s: %d %s", c.what, w.Code, w.Body.String())
		}
	}

	if w := do(t, h, ipFull, "POST", BasePath+"/report", padded(`{"a":1}`, 32<<10)); w.Code != 204 {
		t.Fatalf("report at the limit: %d", w.Code)
	}
	if len(f.reports["0a1b2c3d"]) != 32<<10 {
		t.Fatalf("stored %d bytes", len(f.reports["0a1b2c3d"]))
	}
	for _, edit := range []func(*http.Request){nil, chunked} {
		w := doWith(t, h, ipFull, "POST", BasePath+"/report", padded(`{"b":1}`, 32<<10+1), edit)
		if w.Code != http.StatusRequestEntityTooLarge || w.Body.String() != "report body is larger than 32768 bytes" {
			t.Errorf("report over the limit: %d %s", w.Code, w.Body.String())
		}
	}
	if string(f.reports["0a1b2c3d"][:7]) != `{"a":1}` {
		t.Errorf("a refused report replaced the stored one")
	}
	want := []Counters{{VMID: "0a1b2c3d", BodiesTooLarge: map[string]uint64{BodyQuote: 4, BodyReport: 2}}}
	if got := g.Counters(); !reflect.DeepEqual(got, want) {
		t.Errorf("counters %+v, want %+v", got, want)
	}
}
