package imds

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/giantswarm/vm-manager/gen/apierr"
	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
)

const (
	ipFull    = "10.0.0.2" // every key set
	ipBare    = "10.0.0.3" // nothing optional set
	ipUnknown = "10.0.0.9"
)

// fakeVMs is a port fake: canned VMs and recorded calls.
type fakeVMs struct {
	mu        sync.Mutex
	vms       map[netip.Addr]*hypervisorv1.VirtualMachine
	userData  map[string][]byte
	released  map[string]bool
	keys      map[string][]string
	nonceErr  error
	quoteErr  error
	verified  bool
	quotes    []*attestationv1.VerifyQuoteRequest
	reports   map[string][]byte
	reportErr error
	files     map[string][]byte // "<component>/<file>"; a nil value is a directory
}

func newFake() *fakeVMs {
	return &fakeVMs{
		vms: map[netip.Addr]*hypervisorv1.VirtualMachine{
			netip.MustParseAddr(ipFull): {
				Id: "0a1b2c3d", Name: "full", Hostname: "full-host", Region: "host-1", Zone: "zone-a",
				Network: "net-a", KubernetesVersion: "v1.33.1",
				Metadata: map[string]string{"role": "worker", "empty": ""},
			},
			netip.MustParseAddr(ipBare): {Id: "deadbeef", Name: "bare", Network: "net-b"},
		},
		userData: map[string][]byte{"0a1b2c3d": []byte(`{"ignition":{"version":"3.4.0"}}`)},
		released: map[string]bool{},
		keys:     map[string][]string{"0a1b2c3d": {"ssh-ed25519 AAAA vm-manager", "ssh-ed25519 BBBB user"}},
		verified: true,
		reports:  map[string][]byte{},
		files: map[string][]byte{
			"kubernetes/kubernetes_v1.33.1.raw": []byte("\x00\x01binary\xff"),
			"kubernetes/dir":                    nil,
		},
	}
}

func (f *fakeVMs) ByIP(ip netip.Addr) (*hypervisorv1.VirtualMachine, bool) {
	vm, ok := f.vms[ip]
	return vm, ok
}

func (f *fakeVMs) IssueNonce(_ context.Context, vmID string) ([]byte, error) {
	if f.nonceErr != nil {
		return nil, f.nonceErr
	}
	return bytes.Repeat([]byte{0xab}, 32), nil
}

func (f *fakeVMs) SubmitQuote(_ context.Context, vmID string, q *attestationv1.VerifyQuoteRequest) (*attestationv1.VerifyQuoteResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.quotes = append(f.quotes, q)
	if f.quoteErr != nil {
		return nil, f.quoteErr
	}
	res := &attestationv1.VerifyQuoteResponse{Stage: q.Stage, Verified: f.verified}
	if f.verified && q.Stage == attestationv1.Stage_STAGE_INITRD {
		f.released[vmID] = true
		res.UserDataReleased = true
	}
	if !f.verified {
		res.Message = "pcr 7 mismatch"
	}
	return res, nil
}

func (f *fakeVMs) UserData(vmID string) ([]byte, bool, bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	d, ok := f.userData[vmID]
	return d, ok, f.released[vmID], nil
}

func (f *fakeVMs) SSHKeys(vmID string) []string { return f.keys[vmID] }

func (f *fakeVMs) StoreReport(vmID string, body []byte) error {
	if f.reportErr != nil {
		return f.reportErr
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.reports[vmID] = body
	return nil
}

type nopCloser struct{ io.ReadSeeker }

func (nopCloser) Close() error { return nil }

func (f *fakeVMs) SysupdateFile(component, file string) (io.ReadSeekCloser, int64, error) {
	if strings.ContainsAny(component+file, "/") || component == ".." || file == ".." {
		panic("unsafe name reached the port: " + component + "/" + file)
	}
	b, ok := f.files[component+"/"+file]
	if !ok {
		return nil, 0, fs.ErrNotExist
	}
	if b == nil {
		return nil, 0, apierr.Errorf(apierr.NotFound, "%s/%s is a directory", component, file)
	}
	return nopCloser{bytes.NewReader(b)}, int64(len(b)), nil
}

// do sends one request from ip (a bare address or host:port) and returns the recorded response.
func do(t testing.TB, h http.Handler, ip, method, p string, body []byte, hdr ...string) *httptest.ResponseRecorder {
	t.Helper()
	var rd io.Reader
	if body != nil {
		rd = bytes.NewReader(body)
	}
	r := httptest.NewRequest(method, "http://169.254.169.254"+p, rd)
	r.RemoteAddr = ip
	if _, err := netip.ParseAddr(ip); err == nil {
		r.RemoteAddr = ip + ":40000"
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Set(hdr[i], hdr[i+1])
	}
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

func get(t testing.TB, h http.Handler, ip, key string) *httptest.ResponseRecorder {
	t.Helper()
	return do(t, h, ip, http.MethodGet, BasePath+key, nil)
}

// expect checks status and exact body, and the plain-text conventions of §6.2.
func expect(t *testing.T, w *httptest.ResponseRecorder, status int, body string) {
	t.Helper()
	if w.Code != status || w.Body.String() != body {
		t.Fatalf("got %d %q, want %d %q", w.Code, w.Body.String(), status, body)
	}
	if status == http.StatusNoContent {
		return
	}
	if ct := w.Header().Get("Content-Type"); ct != "text/plain; charset=utf-8" {
		t.Errorf("Content-Type %q", ct)
	}
	if cl := w.Header().Get("Content-Length"); cl != strconv.Itoa(len(body)) {
		t.Errorf("Content-Length %q, body %d bytes", cl, len(body))
	}
}

func TestUnknownAddressForbidden(t *testing.T) {
	h := New(newFake(), nil)
	for _, tc := range []struct{ method, path string }{
		{"GET", "/giantswarm/v1/hostname"},
		{"GET", "/giantswarm/v1/user-data"},
		{"GET", "/giantswarm/v1/attest/nonce"},
		{"POST", "/giantswarm/v1/attest/quote"},
		{"POST", "/giantswarm/v1/report"},
		{"GET", "/giantswarm/v1/sysupdate/kubernetes/kubernetes_v1.33.1.raw"},
		{"GET", "/giantswarm/v1/no-such-key"},
		{"DELETE", "/giantswarm/v1/hostname"},
		{"GET", "/"},
		{"GET", "/giantswarm/v1/../x"},
	} {
		w := do(t, h, ipUnknown, tc.method, tc.path, []byte("{}"))
		expect(t, w, http.StatusForbidden, ForbiddenBody)
	}
	// A peer address that does not parse is no VM either.
	w := do(t, h, "garbage", "GET", "/giantswarm/v1/hostname", nil)
	expect(t, w, http.StatusForbidden, ForbiddenBody)
}

func TestForwardedForIgnored(t *testing.T) {
	h := New(newFake(), nil)
	w := do(t, h, ipUnknown, "GET", BasePath+"/instance-id", nil, "X-Forwarded-For", ipFull, "X-Real-IP", ipFull)
	expect(t, w, http.StatusForbidden, ForbiddenBody)
	w = do(t, h, ipBare, "GET", BasePath+"/instance-id", nil, "X-Forwarded-For", ipFull)
	expect(t, w, http.StatusOK, "deadbeef")
}

func TestIPv4MappedPeer(t *testing.T) {
	h := New(newFake(), nil)
	w := do(t, h, "[::ffff:"+ipFull+"]:5555", "GET", BasePath+"/instance-id", nil)
	expect(t, w, http.StatusOK, "0a1b2c3d")
}

func TestKeys(t *testing.T) {
	h := New(newFake(), nil)
	for _, tc := range []struct {
		ip, key string
		status  int
		body    string
	}{
		{ipFull, "/hostname", 200, "full-host"},
		{ipBare, "/hostname", 200, "bare"},
		{ipFull, "/region", 200, "host-1"},
		{ipBare, "/region", 404, ""},
		{ipFull, "/zone", 200, "zone-a"},
		{ipBare, "/zone", 200, "net-b"},
		{ipFull, "/instance-id", 200, "0a1b2c3d"},
		{ipFull, "/kubernetes-version", 200, "v1.33.1"},
		{ipBare, "/kubernetes-version", 404, ""},
		{ipFull, "/metadata/role", 200, "worker"},
		{ipFull, "/metadata/empty", 200, ""},
		{ipFull, "/metadata/missing", 404, ""},
		{ipBare, "/metadata/role", 404, ""},
		{ipFull, "/public-keys/", 200, "0\n1"},
		{ipBare, "/public-keys/", 200, ""},
		{ipFull, "/public-keys/0", 200, "ssh-ed25519 AAAA vm-manager"},
		{ipFull, "/public-keys/1", 200, "ssh-ed25519 BBBB user"},
		{ipFull, "/public-keys/01", 200, "ssh-ed25519 BBBB user"},
		{ipFull, "/public-keys/2", 404, ""},
		{ipFull, "/public-keys/-1", 404, ""},
		{ipFull, "/public-keys/+1", 404, ""},
		{ipFull, "/public-keys/x", 404, ""},
		{ipFull, "/public-keys/99999999999999999999", 404, ""},
		{ipBare, "/public-keys/0", 404, ""},
	} {
		t.Run(tc.ip+tc.key, func(t *testing.T) {
			expect(t, get(t, h, tc.ip, tc.key), tc.status, tc.body)
		})
	}
}

func TestNoTrailingNewline(t *testing.T) {
	h := New(newFake(), nil)
	for _, k := range []string{"/hostname", "/region", "/zone", "/instance-id", "/public-keys/", "/public-keys/0", "/attest/nonce"} {
		w := get(t, h, ipFull, k)
		if w.Code != 200 || strings.HasSuffix(w.Body.String(), "\n") {
			t.Errorf("%s: %d %q", k, w.Code, w.Body.String())
		}
	}
}

func TestRoutingStatuses(t *testing.T) {
	h := New(newFake(), nil)
	for _, tc := range []struct {
		method, path string
		status       int
	}{
		{"POST", "/giantswarm/v1/hostname", 405},
		{"PUT", "/giantswarm/v1/user-data", 405},
		{"GET", "/giantswarm/v1/attest/quote", 405},
		{"GET", "/giantswarm/v1/report", 405},
		{"POST", "/giantswarm/v1/attest/nonce", 405},
		{"GET", "/giantswarm/v1/no-such-key", 404},
		{"GET", "/giantswarm/v1", 404},
		{"GET", "/giantswarm/v1/", 404},
		{"GET", "/latest/meta-data/hostname", 404},
		{"GET", "/giantswarm/v1/hostname/extra", 404},
		{"GET", "/giantswarm/v1/public-keys/0/openssh-key", 404},
		{"GET", "/giantswarm/v1/metadata/", 404},
		{"GET", "/giantswarm/v1//hostname", 404},
		{"GET", "/giantswarm/v1/./hostname", 404},
		{"GET", "/giantswarm/v2/../v1/hostname", 404},
		{"HEAD", "/giantswarm/v1/hostname", 200},
	} {
		w := do(t, h, ipFull, tc.method, tc.path, nil)
		if w.Code != tc.status {
			t.Errorf("%s %s: %d, want %d", tc.method, tc.path, w.Code, tc.status)
		}
		if tc.status == 405 && w.Header().Get("Allow") == "" {
			t.Errorf("%s %s: 405 without Allow", tc.method, tc.path)
		}
	}
}

func TestUserDataGate(t *testing.T) {
	f := newFake()
	h := New(f, nil)
	w := get(t, h, ipFull, "/user-data")
	expect(t, w, http.StatusServiceUnavailable, UserDataGated)
	if ra := w.Header().Get("Retry-After"); ra != "2" {
		t.Fatalf("Retry-After %q", ra)
	}
	// An initrd quote that verifies releases it.
	expectQuote(t, do(t, h, ipFull, "POST", BasePath+"/attest/quote", quoteBody(nil)), 200,
		QuoteResponse{Stage: "initrd", Verified: true, UserDataReleased: true})
	expect(t, get(t, h, ipFull, "/user-data"), http.StatusOK, `{"ignition":{"version":"3.4.0"}}`)

	w = get(t, h, ipBare, "/user-data")
	expect(t, w, http.StatusNoContent, "")
	if w.Header().Get("Content-Length") != "" && w.Header().Get("Content-Length") != "0" {
		t.Errorf("204 with Content-Length %q", w.Header().Get("Content-Length"))
	}
}

func TestUserDataError(t *testing.T) {
	h := New(errUserData{newFake()}, nil)
	if w := get(t, h, ipFull, "/user-data"); w.Code != 500 {
		t.Fatalf("got %d", w.Code)
	}
}

type errUserData struct{ *fakeVMs }

func (errUserData) UserData(string) ([]byte, bool, bool, error) {
	return nil, false, false, errors.New("disk on fire")
}

func TestNonce(t *testing.T) {
	f := newFake()
	h := New(f, nil)
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
	h := New(f, nil)
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
	h := New(f, nil)
	expectQuote(t, do(t, h, ipFull, "POST", BasePath+"/attest/quote", quoteBody(nil)), 403,
		QuoteResponse{Stage: "initrd", Message: "pcr 7 mismatch"})
	expect(t, get(t, h, ipFull, "/user-data"), 503, UserDataGated)
}

func TestQuoteBadRequest(t *testing.T) {
	f := newFake()
	h := New(f, nil)
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
		{errors.New("secret detail"), 500, AttestationUnavailable},
	} {
		f := newFake()
		f.quoteErr = tc.err
		h := New(f, nil)
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
	h := New(f, nil)

	w := do(t, h, ipFull, "POST", BasePath+"/attest/quote", padded(string(quoteBody(nil)), MaxBodyBytes))
	if w.Code != 200 {
		t.Fatalf("quote of 8 MiB: %d %s", w.Code, w.Body.String())
	}
	w = do(t, h, ipFull, "POST", BasePath+"/attest/quote", padded(string(quoteBody(nil)), MaxBodyBytes+1))
	if w.Code != 400 {
		t.Fatalf("quote over 8 MiB: %d", w.Code)
	}
	// A huge base64 field is cut at the limit, not buffered.
	big := quoteBody(map[string]any{"event_log": base64.StdEncoding.EncodeToString(make([]byte, 7<<20))})
	if w := do(t, h, ipFull, "POST", BasePath+"/attest/quote", big); w.Code != 400 {
		t.Fatalf("quote with 9.3 MiB body: %d", w.Code)
	}

	if w := do(t, h, ipFull, "POST", BasePath+"/report", padded(`{"a":1}`, MaxBodyBytes)); w.Code != 204 {
		t.Fatalf("report of 8 MiB: %d", w.Code)
	}
	if len(f.reports["0a1b2c3d"]) != MaxBodyBytes {
		t.Fatalf("stored %d bytes", len(f.reports["0a1b2c3d"]))
	}
	if w := do(t, h, ipFull, "POST", BasePath+"/report", padded(`{"a":1}`, MaxBodyBytes+1)); w.Code != 400 {
		t.Fatalf("report over 8 MiB: %d", w.Code)
	}
}

func TestReport(t *testing.T) {
	f := newFake()
	h := New(f, nil)
	for _, body := range []string{"", "{", "not json", `{"a":1}x`} {
		if w := do(t, h, ipFull, "POST", BasePath+"/report", []byte(body)); w.Code != 400 {
			t.Errorf("%q: %d", body, w.Code)
		}
	}
	if len(f.reports) != 0 {
		t.Fatal("invalid report stored")
	}
	w := do(t, h, ipFull, "POST", BasePath+"/report", []byte(`{"version":1,"facts":[]}`))
	expect(t, w, 204, "")
	if string(f.reports["0a1b2c3d"]) != `{"version":1,"facts":[]}` {
		t.Fatalf("stored %q", f.reports["0a1b2c3d"])
	}
	f.reportErr = errors.New("disk full")
	if w := do(t, h, ipFull, "POST", BasePath+"/report", []byte(`{}`)); w.Code != 500 {
		t.Fatalf("store failure: %d", w.Code)
	}
}

func TestSysupdate(t *testing.T) {
	h := New(newFake(), nil)
	w := get(t, h, ipBare, "/sysupdate/kubernetes/kubernetes_v1.33.1.raw")
	if w.Code != 200 || w.Body.String() != "\x00\x01binary\xff" {
		t.Fatalf("got %d %q", w.Code, w.Body.String())
	}
	if ct := w.Header().Get("Content-Type"); ct != "application/octet-stream" {
		t.Errorf("Content-Type %q", ct)
	}
	if cl := w.Header().Get("Content-Length"); cl != "9" {
		t.Errorf("Content-Length %q", cl)
	}
	for _, p := range []string{
		"/sysupdate/kubernetes/missing.raw",
		"/sysupdate/missing/kubernetes_v1.33.1.raw",
		"/sysupdate/kubernetes/dir",
		"/sysupdate/kubernetes",
		"/sysupdate/kubernetes/",
		"/sysupdate/",
		"/sysupdate/a/b/c",
		"/sysupdate/kubernetes/dir/x",
		"/sysupdate/kubernetes/../kubernetes/kubernetes_v1.33.1.raw",
		"/sysupdate/../../etc/passwd",
		"/sysupdate/kubernetes/..",
		"/sysupdate/../x",
		"/sysupdate/kubernetes/%2e%2e",
		"/sysupdate/%2e%2e/x",
		"/sysupdate/kubernetes/a%2Fb",
		"/sysupdate/kubernetes/..%2Fpasswd",
		"/sysupdate/kubernetes/a%5Cb",
		"/sysupdate/./kubernetes_v1.33.1.raw",
	} {
		if w := get(t, h, ipBare, p); w.Code != 404 {
			t.Errorf("%s: %d %q", p, w.Code, w.Body.String())
		}
	}
	if w := do(t, h, ipBare, "POST", BasePath+"/sysupdate/kubernetes/kubernetes_v1.33.1.raw", nil); w.Code != 405 {
		t.Errorf("POST: %d", w.Code)
	}
}

func TestSysupdateError(t *testing.T) {
	h := New(errFiles{newFake()}, nil)
	if w := get(t, h, ipBare, "/sysupdate/a/b"); w.Code != 500 {
		t.Fatalf("got %d", w.Code)
	}
}

type errFiles struct{ *fakeVMs }

func (errFiles) SysupdateFile(string, string) (io.ReadSeekCloser, int64, error) {
	return nil, 0, errors.New("permission denied")
}

func TestHwdbRecord(t *testing.T) {
	rec := HwdbRecord()
	want := "dmi:*:svnGiantSwarm:*\n" +
		" IMDS_VENDOR=giantswarm\n" +
		" IMDS_DATA_URL=http://169.254.169.254/giantswarm/v1\n" +
		" IMDS_ADDRESS_IPV4=169.254.169.254\n" +
		" IMDS_KEY_HOSTNAME=/hostname\n" +
		" IMDS_KEY_REGION=/region\n" +
		" IMDS_KEY_ZONE=/zone\n" +
		" IMDS_KEY_SSH_KEY=/public-keys/0\n"
	if !strings.HasSuffix(rec, want) {
		t.Fatalf("record:\n%s\nwant it to end with:\n%s", rec, want)
	}
}

// TestHwdbParity keeps the hwdb record and the routes equal: every key the
// record names is served (200 for a VM with everything set), and every key
// the contract gives an hwdb property is in the record.
func TestHwdbParity(t *testing.T) {
	h := New(newFake(), nil)
	props := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(HwdbRecord()))
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, " ") {
			continue
		}
		k, v, ok := strings.Cut(strings.TrimPrefix(line, " "), "=")
		if !ok {
			t.Fatalf("bad property line %q", line)
		}
		props[k] = v
	}
	u, err := url.Parse(props["IMDS_DATA_URL"])
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for k, v := range props {
		if !strings.HasPrefix(k, "IMDS_KEY_") {
			continue
		}
		n++
		w := do(t, h, ipFull, "GET", u.Path+v, nil)
		if w.Code != 200 || w.Body.Len() == 0 {
			t.Errorf("%s=%s is not served: %d", k, v, w.Code)
		}
	}
	for _, want := range []string{"IMDS_KEY_HOSTNAME", "IMDS_KEY_REGION", "IMDS_KEY_ZONE", "IMDS_KEY_SSH_KEY"} {
		if _, ok := props[want]; !ok {
			t.Errorf("record lacks %s", want)
		}
	}
	if n != 4 {
		t.Errorf("%d IMDS_KEY_* properties, want 4", n)
	}
	if props["IMDS_ADDRESS_IPV4"] != u.Hostname() {
		t.Errorf("address %q vs data URL %q", props["IMDS_ADDRESS_IPV4"], props["IMDS_DATA_URL"])
	}
	// Every key row is routed with its method.
	for _, k := range Keys {
		p := strings.NewReplacer("{$}", "", "{index}", "0", "{key}", "role", "{component}", "kubernetes", "{file}", "kubernetes_v1.33.1.raw").Replace(k.Path)
		var body []byte
		if k.Method == http.MethodPost {
			body = []byte("{}")
		}
		if w := do(t, h, ipFull, k.Method, BasePath+p, body); w.Code == 404 && w.Body.Len() != 0 || w.Code == 405 {
			t.Errorf("%s %s is not routed: %d %q", k.Method, p, w.Code, w.Body.String())
		}
	}
}
