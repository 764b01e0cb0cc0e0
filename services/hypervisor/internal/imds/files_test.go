package imds

import (
	"errors"
	"io"
	"testing"
)

func TestReport(t *testing.T) {
	f := newFake()
	h := New(f, nil, nil)
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
	h := New(newFake(), nil, nil)
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
	h := New(errFiles{newFake()}, nil, nil)
	if w := get(t, h, ipBare, "/sysupdate/a/b"); w.Code != 500 {
		t.Fatalf("got %d", w.Code)
	}
}

type errFiles struct{ *fakeVMs }

func (errFiles) SysupdateFile(string, string, string) (io.ReadSeekCloser, int64, error) {
	return nil, 0, errors.New("permission denied")
}
