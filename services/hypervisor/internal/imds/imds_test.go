package imds

import (
	"bufio"
	"bytes"
	"context"
	"errors"
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

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
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
	members   map[string]bool   // unclaimed warm-pool members
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

func (f *fakeVMs) AwaitingClaim(vmID string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.members[vmID]
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

func (f *fakeVMs) SysupdateFile(_, component, file string) (io.ReadSeekCloser, int64, error) {
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
	return doWith(t, h, ip, method, p, body, nil, hdr...)
}

// doWith is do with a last edit of the request.
func doWith(t testing.TB, h http.Handler, ip, method, p string, body []byte, edit func(*http.Request), hdr ...string) *httptest.ResponseRecorder {
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
	if edit != nil {
		edit(r)
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
	h := New(newFake(), nil, nil)
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
	h := New(newFake(), nil, nil)
	w := do(t, h, ipUnknown, "GET", BasePath+"/instance-id", nil, "X-Forwarded-For", ipFull, "X-Real-IP", ipFull)
	expect(t, w, http.StatusForbidden, ForbiddenBody)
	w = do(t, h, ipBare, "GET", BasePath+"/instance-id", nil, "X-Forwarded-For", ipFull)
	expect(t, w, http.StatusOK, "deadbeef")
}

func TestIPv4MappedPeer(t *testing.T) {
	h := New(newFake(), nil, nil)
	w := do(t, h, "[::ffff:"+ipFull+"]:5555", "GET", BasePath+"/instance-id", nil)
	expect(t, w, http.StatusOK, "0a1b2c3d")
}

func TestKeys(t *testing.T) {
	h := New(newFake(), nil, nil)
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
	h := New(newFake(), nil, nil)
	for _, k := range []string{"/hostname", "/region", "/zone", "/instance-id", "/public-keys/", "/public-keys/0", "/attest/nonce"} {
		w := get(t, h, ipFull, k)
		if w.Code != 200 || strings.HasSuffix(w.Body.String(), "\n") {
			t.Errorf("%s: %d %q", k, w.Code, w.Body.String())
		}
	}
}

func TestRoutingStatuses(t *testing.T) {
	h := New(newFake(), nil, nil)
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
	h := New(f, nil, nil)
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

// An unclaimed pool member gets 503 asked again at once, even with its
// initrd quote verified and user-data of its own on disk: what it gets is
// the claimer's, after the claim.
func TestUserDataAwaitingClaim(t *testing.T) {
	f := newFake()
	h := New(f, nil, nil)
	expectQuote(t, do(t, h, ipFull, "POST", BasePath+"/attest/quote", quoteBody(nil)), 200,
		QuoteResponse{Stage: "initrd", Verified: true, UserDataReleased: true})
	id := f.vms[netip.MustParseAddr(ipFull)].GetId()
	f.mu.Lock()
	f.members = map[string]bool{id: true}
	f.mu.Unlock()
	w := get(t, h, ipFull, "/user-data")
	expect(t, w, http.StatusServiceUnavailable, UserDataAwaitingClaim)
	if ra := w.Header().Get("Retry-After"); ra != "0" {
		t.Fatalf("Retry-After %q, want 0", ra)
	}
	f.mu.Lock()
	f.members = nil // claimed
	f.mu.Unlock()
	expect(t, get(t, h, ipFull, "/user-data"), http.StatusOK, `{"ignition":{"version":"3.4.0"}}`)
}

func TestUserDataError(t *testing.T) {
	h := New(errUserData{newFake()}, nil, nil)
	if w := get(t, h, ipFull, "/user-data"); w.Code != 500 {
		t.Fatalf("got %d", w.Code)
	}
}

type errUserData struct{ *fakeVMs }

func (errUserData) UserData(string) ([]byte, bool, bool, error) {
	return nil, false, false, errors.New("disk on fire")
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
	h := New(newFake(), nil, nil)
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
