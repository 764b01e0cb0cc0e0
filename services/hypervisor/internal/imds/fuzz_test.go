package imds

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"testing"
)

// Fuzz flags: which faults the port injects, and the user-data gate.
const (
	fuzzFaults   = 1 << 0 // every fallible port call fails
	fuzzReleased = 1 << 1 // user-data released
	fuzzRejected = 1 << 2 // quotes do not verify
)

// faultyVMs fails every port call that can fail.
type faultyVMs struct{ *fakeVMs }

func (faultyVMs) UserData(string) ([]byte, bool, bool, error) {
	return nil, false, false, errors.New("disk on fire")
}

func (faultyVMs) SysupdateFile(string, string, string) (io.ReadSeekCloser, int64, error) {
	return nil, 0, errors.New("permission denied")
}

// documented500 is where contract §6.3 allows a 500: an attestor or store
// failure behind the key.
func documented500(method, p string) bool {
	if method == "HEAD" { // served by the GET routes
		method = "GET"
	}
	switch {
	case method == "GET" && p == BasePath+"/user-data",
		method == "GET" && p == BasePath+"/attest/nonce",
		method == "POST" && p == BasePath+"/attest/quote",
		method == "POST" && p == BasePath+"/report":
		return true
	}
	return method == "GET" && strings.HasPrefix(p, BasePath+"/sysupdate/")
}

// FuzzIMDS sends arbitrary requests (method, path, X-Forwarded-For, body and
// TCP peer) to the IMDS handler. A peer that holds no lease gets 403 and the
// fixed body whatever it forges; a VM never gets a 5xx except the documented
// 500s when the port fails and the 503 of gated user-data, and never reaches
// the port with a sysupdate name that leaves its directory (the fake panics).
func FuzzIMDS(f *testing.F) {
	quote := string(quoteBody(nil))
	for _, s := range []struct {
		method, path, xff string
		body              string
		remote            string
		flags             uint8
	}{
		{"GET", BasePath + "/hostname", "", "", ipFull + ":40000", 0},
		{"GET", BasePath + "/hostname", ipFull, "", ipUnknown + ":40000", 0},
		{"GET", BasePath + "/user-data", ipFull + ", " + ipBare, "", ipUnknown + ":1", fuzzReleased},
		{"GET", BasePath + "/user-data", "", "", ipFull + ":40000", 0},
		{"GET", BasePath + "/user-data", "", "", ipFull + ":40000", fuzzFaults},
		{"GET", BasePath + "/public-keys/", "", "", ipFull + ":40000", 0},
		{"GET", BasePath + "/public-keys/18446744073709551616", "", "", ipFull + ":40000", 0},
		{"GET", BasePath + "/public-keys/+1", "", "", ipFull + ":40000", 0},
		{"GET", BasePath + "/metadata/empty", "", "", ipFull + ":40000", 0},
		{"GET", BasePath + "/metadata/..%2F..%2Fetc%2Fpasswd", "", "", ipFull + ":40000", 0},
		{"GET", BasePath + "/attest/nonce", "", "", ipFull + ":40000", fuzzFaults},
		{"POST", BasePath + "/attest/quote", "", quote, ipFull + ":40000", 0},
		{"POST", BasePath + "/attest/quote", "", quote, ipFull + ":40000", fuzzRejected},
		{"POST", BasePath + "/attest/quote", "", quote, ipFull + ":40000", fuzzFaults},
		{"POST", BasePath + "/attest/quote", "", quote[:len(quote)/2], ipFull + ":40000", 0},
		{"POST", BasePath + "/report", "", `{"mediaType":"application/vnd.systemd.report","metrics":[]}`, ipFull + ":40000", 0},
		{"POST", BasePath + "/report", "", `{"a":`, ipFull + ":40000", fuzzFaults},
		{"GET", BasePath + "/sysupdate/kubernetes/kubernetes_v1.33.1.raw", "", "", ipBare + ":40000", 0},
		{"GET", BasePath + "/sysupdate/kubernetes/%2e%2e", "", "", ipBare + ":40000", 0},
		{"GET", BasePath + "/sysupdate/%2Fetc/passwd", "", "", ipBare + ":40000", 0},
		{"GET", BasePath + "/sysupdate/kubernetes/..%2F..%2Fetc%2Fpasswd", "", "", ipBare + ":40000", fuzzFaults},
		{"GET", BasePath + "/sysupdate/..%5C../x", "", "", ipBare + ":40000", 0},
		{"GET", BasePath + "/../../etc/passwd", "", "", ipFull + ":40000", 0},
		{"GET", "//giantswarm/v1//hostname", "", "", ipFull + ":40000", 0},
		{"DELETE", BasePath + "/hostname", "", "", ipFull + ":40000", 0},
		{"HEAD", BasePath + "/sysupdate/kubernetes/kubernetes_v1.33.1.raw", "", "", ipFull + ":40000", 0},
		{"GET", BasePath + "/instance-id", "", "", "[::ffff:" + ipFull + "]:40000", 0},
		{"GET", BasePath + "/instance-id", "", "", ipFull, 0},
		{"GET", BasePath + "/instance-id", "", "", "garbage", 0},
		{"GET", BasePath + "/instance-id", "", "", "[fe80::1%eth0]:80", 0},
	} {
		f.Add(s.method, s.path, s.xff, []byte(s.body), s.remote, s.flags)
	}
	f.Fuzz(func(t *testing.T, method, target, xff string, body []byte, remote string, flags uint8) {
		// What net/http's server would hand the handler; anything it
		// refuses itself never gets here.
		if method == "" {
			method = "GET"
		}
		if !token(method) {
			return
		}
		u, err := url.ParseRequestURI(target)
		if err != nil || u.Host != "" || !strings.HasPrefix(u.Path, "/") {
			return
		}
		fake := newFake()
		fake.released["0a1b2c3d"] = flags&fuzzReleased != 0
		fake.verified = flags&fuzzRejected == 0
		var port VMs = fake
		if flags&fuzzFaults != 0 {
			fake.nonceErr = errors.New("attestation down")
			fake.quoteErr = errors.New("attestation down")
			fake.reportErr = errors.New("disk full")
			port = faultyVMs{fake}
		}
		r := &http.Request{
			Method: method, URL: u, RequestURI: target,
			Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
			Header: http.Header{"X-Forwarded-For": {xff}, "X-Real-Ip": {xff}, "Forwarded": {"for=" + xff}},
			Host:   Address, RemoteAddr: remote,
			Body:          io.NopCloser(bytes.NewReader(body)),
			ContentLength: int64(len(body)),
		}
		w := httptest.NewRecorder()
		New(port, nil, nil).ServeHTTP(w, r.WithContext(context.Background()))

		lease := false
		if ap, err := netip.ParseAddrPort(remote); err == nil {
			a := ap.Addr().Unmap().WithZone("")
			lease = a == netip.MustParseAddr(ipFull) || a == netip.MustParseAddr(ipBare)
		}
		if !lease {
			if w.Code != http.StatusForbidden || w.Body.String() != ForbiddenBody {
				t.Fatalf("peer %q (X-Forwarded-For %q) got %d %q, want 403", remote, xff, w.Code, w.Body.String())
			}
			return
		}
		switch c := w.Code; {
		case c == http.StatusForbidden:
			if !(fake.verified == false && method == "POST" && u.Path == BasePath+"/attest/quote") {
				t.Fatalf("VM %s got 403 on %s %q", remote, method, target)
			}
		case c == http.StatusServiceUnavailable:
			if u.Path != BasePath+"/user-data" || fake.released["0a1b2c3d"] || flags&fuzzFaults != 0 {
				t.Fatalf("503 on %s %q", method, target)
			}
		case c == http.StatusInternalServerError:
			if flags&fuzzFaults == 0 || !documented500(method, u.Path) {
				t.Fatalf("500 on %s %q (faults %t): %q", method, target, flags&fuzzFaults != 0, w.Body.String())
			}
		case c >= 500 || c < 200:
			t.Fatalf("status %d on %s %q", c, method, target)
		case c == http.StatusOK, c == http.StatusNoContent, c == http.StatusBadRequest, c == http.StatusNotFound,
			c == http.StatusMethodNotAllowed, c == http.StatusConflict:
		default:
			t.Fatalf("unexpected status %d on %s %q", c, method, target)
		}
		if cl := w.Header().Get("Content-Length"); cl != "" && method != "HEAD" && cl != strconv.Itoa(w.Body.Len()) {
			t.Fatalf("%s %q: Content-Length %s, body %d bytes", method, target, cl, w.Body.Len())
		}
	})
}

// token reports whether s is an HTTP method net/http accepts.
func token(s string) bool {
	for _, c := range []byte(s) {
		if c <= ' ' || c >= 0x7f || strings.IndexByte("()<>@,;:\\\"/[]?={}", c) >= 0 {
			return false
		}
	}
	return s != ""
}

// traversalTargets are request-targets, as a guest writes them on the wire,
// that try to leave <image-dir>/sysupdate/<component>/.
var traversalTargets = []string{
	BasePath + "/sysupdate/kubernetes/../../../etc/passwd",
	BasePath + "/sysupdate/../../etc/passwd",
	BasePath + "/sysupdate/kubernetes/..",
	BasePath + "/sysupdate/kubernetes/./SHA256SUMS",
	BasePath + "/sysupdate/kubernetes/%2e%2e",
	BasePath + "/sysupdate/%2e%2e/%2e%2e",
	BasePath + "/sysupdate/%2E%2E/passwd",
	BasePath + "/sysupdate/kubernetes/..%2F..%2F..%2Fetc%2Fpasswd",
	BasePath + "/sysupdate/kubernetes/..%2f..%2fsecret",
	BasePath + "/sysupdate/..%2F..%2F/passwd",
	BasePath + "/sysupdate/kubernetes/%2Fetc%2Fpasswd",
	BasePath + "/sysupdate/%2Fetc/passwd",
	BasePath + "/sysupdate//etc/passwd",
	BasePath + "/sysupdate/kubernetes//etc/passwd",
	BasePath + "/sysupdate///etc/passwd",
	BasePath + "/sysupdate/kubernetes/..%5C..%5Csecret",
	BasePath + "/sysupdate/kubernetes/a%00b",
	BasePath + "/sysupdate/kubernetes/%2e",
	BasePath + "/sysupdate/kubernetes/SHA256SUMS/..",
	BasePath + "/sysupdate/kubernetes/SHA256SUMS%2F..%2F..%2Fsecret",
	"http://169.254.169.254" + BasePath + "/sysupdate/../../../etc/passwd",
	"http://169.254.169.254" + BasePath + "/sysupdate/%2e%2e/%2e%2e/secret",
	BasePath + "/../../../etc/passwd",
	"/etc/passwd",
}

// TestSysupdateTraversalOnTheWire parses each target the way net/http's
// server does (http.ReadRequest) before the handler sees it: every one is a
// 404, and no unsafe name reaches the port (the fake panics on one).
func TestSysupdateTraversalOnTheWire(t *testing.T) {
	h := New(newFake(), nil, nil)
	parsed := 0
	for _, target := range traversalTargets {
		raw := "GET " + target + " HTTP/1.1\r\nHost: 169.254.169.254\r\nX-Forwarded-For: " + ipFull + "\r\n\r\n"
		r, err := http.ReadRequest(bufio.NewReader(strings.NewReader(raw)))
		if err != nil {
			continue // the server answers 400 itself
		}
		parsed++
		r.RemoteAddr = ipFull + ":40000"
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != http.StatusNotFound {
			t.Errorf("%s: %d %q, want 404", target, w.Code, w.Body.String())
		}
	}
	if parsed < len(traversalTargets)-2 {
		t.Errorf("only %d of %d targets parse", parsed, len(traversalTargets))
	}
}
