package imdsclient

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// fakeClock makes the 503 wait instant: Sleep advances Now.
type fakeClock struct {
	t     time.Time
	slept []time.Duration
}

func (c *fakeClock) now() time.Time { return c.t }
func (c *fakeClock) sleep(_ context.Context, d time.Duration) error {
	c.slept = append(c.slept, d)
	c.t = c.t.Add(d)
	return nil
}

func newClient(t *testing.T, h http.Handler) (*Client, *fakeClock) {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	c := New(srv.URL + "/giantswarm/v1")
	clk := &fakeClock{t: time.Unix(1e9, 0)}
	c.Now, c.Sleep = clk.now, clk.sleep
	return c, clk
}

func TestKeys(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /giantswarm/v1/hostname", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("vm-1")) })
	mux.HandleFunc("GET /giantswarm/v1/public-keys/", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("0\n1\n2")) })
	mux.HandleFunc("GET /giantswarm/v1/public-keys/0", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("ssh-ed25519 AAAA vmm")) })
	mux.HandleFunc("GET /giantswarm/v1/public-keys/1", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(404) })
	mux.HandleFunc("GET /giantswarm/v1/public-keys/2", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("ssh-rsa BBBB user@host\n")) })
	c, _ := newClient(t, mux)
	ctx := context.Background()
	if h, err := c.Hostname(ctx); err != nil || h != "vm-1" {
		t.Errorf("hostname %q %v", h, err)
	}
	keys, err := c.PublicKeys(ctx)
	if err != nil || strings.Join(keys, "|") != "ssh-ed25519 AAAA vmm|ssh-rsa BBBB user@host" {
		t.Errorf("keys %q %v", keys, err)
	}
	if _, err := c.Text(ctx, "/region"); !errors.Is(err, ErrNotFound) {
		t.Errorf("unset key: %v", err)
	}
}

func TestEmptyKeyList(t *testing.T) {
	c, _ := newClient(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	keys, err := c.PublicKeys(context.Background())
	if err != nil || len(keys) != 0 {
		t.Fatalf("%q %v", keys, err)
	}
}

// Transport errors and 5xx are retried a few times; 403 is not.
func TestRetries(t *testing.T) {
	var n atomic.Int32
	c, clk := newClient(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/giantswarm/v1/hostname":
			if n.Add(1) < 3 {
				http.Error(w, "busy", 500)
				return
			}
			w.Write([]byte("late"))
		default:
			http.Error(w, "forbidden: client address is not a managed VM", 403)
		}
	}))
	if h, err := c.Hostname(context.Background()); err != nil || h != "late" || n.Load() != 3 {
		t.Errorf("%q %v after %d", h, err, n.Load())
	}
	if len(clk.slept) != 2 || clk.slept[1] != 2*clk.slept[0] {
		t.Errorf("backoff %v", clk.slept)
	}
	if _, err := c.Text(context.Background(), "/zone"); err == nil || !strings.Contains(err.Error(), "403") {
		t.Errorf("403: %v", err)
	}

	c.HTTP.Timeout = 200 * time.Millisecond
	c.BaseURL = "http://127.0.0.1:1/giantswarm/v1" // nothing listens
	if _, err := c.Hostname(context.Background()); err == nil {
		t.Error("no server: no error")
	}
}

func TestUserData(t *testing.T) {
	for _, tc := range []struct {
		name    string
		gated   int // 503s before the answer
		status  int
		body    string
		want    string
		wantErr error
		slept   int
	}{
		{name: "released", status: 200, body: `{"ignition":{}}`, want: `{"ignition":{}}`},
		{name: "none", status: 204, wantErr: ErrNoUserData},
		{name: "gated then released", gated: 3, status: 200, body: "x", want: "x", slept: 3},
		{name: "gated for good", gated: 1000, wantErr: ErrGated, slept: 30}, // 60 s / Retry-After 2
	} {
		t.Run(tc.name, func(t *testing.T) {
			var n atomic.Int32
			c, clk := newClient(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != "/giantswarm/v1/user-data" {
					http.NotFound(w, r)
					return
				}
				if int(n.Add(1)) <= tc.gated {
					w.Header().Set("Retry-After", "2")
					http.Error(w, "user-data is released after the initrd-stage attestation verifies", 503)
					return
				}
				w.WriteHeader(tc.status)
				w.Write([]byte(tc.body))
			}))
			var reasons []string
			b, err := c.UserData(context.Background(), 60*time.Second, func(reason string, d time.Duration) {
				reasons = append(reasons, reason)
				if d != 2*time.Second {
					t.Errorf("retry after %s", d)
				}
			})
			if !errors.Is(err, tc.wantErr) || string(b) != tc.want {
				t.Fatalf("%q %v", b, err)
			}
			if len(clk.slept) != tc.slept {
				t.Errorf("slept %d times, want %d", len(clk.slept), tc.slept)
			}
			if tc.gated > 0 && !strings.Contains(reasons[0], "initrd-stage attestation") {
				t.Errorf("reason %q", reasons[0])
			}
			if tc.wantErr == ErrGated && !strings.Contains(err.Error(), "after 1m0s") {
				t.Errorf("message %v", err)
			}
		})
	}
}

func TestRetryAfter(t *testing.T) {
	for in, want := range map[string]time.Duration{
		"2": 2 * time.Second, "": 5 * time.Second, "x": 5 * time.Second, "0": 100 * time.Millisecond,
		"-1": 5 * time.Second, "Wed, 21 Oct 2015 07:28:00 GMT": 5 * time.Second,
	} {
		if got := RetryAfter(in, 5*time.Second); got != want {
			t.Errorf("%q: %s, want %s", in, got, want)
		}
	}
}

func TestPostReport(t *testing.T) {
	var got struct {
		method, ctype, body string
	}
	status := 204
	c, _ := newClient(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/giantswarm/v1/report" {
			http.NotFound(w, r)
			return
		}
		b, _ := io.ReadAll(r.Body)
		got.method, got.ctype, got.body = r.Method, r.Header.Get("Content-Type"), string(b)
		if status != 204 {
			http.Error(w, "report must be valid JSON", status)
			return
		}
		w.WriteHeader(status)
	}))
	ctx := context.Background()
	if err := c.PostReport(ctx, []byte(`{"a":1}`)); err != nil {
		t.Fatal(err)
	}
	if got.method != "POST" || got.ctype != "application/json" || got.body != `{"a":1}` {
		t.Errorf("request %+v", got)
	}
	status = 400
	if err := c.PostReport(ctx, []byte(`{`)); err == nil || !strings.Contains(err.Error(), "400") || !strings.Contains(err.Error(), "valid JSON") {
		t.Errorf("400: %v", err)
	}
}

func TestKubernetesVersionAndSysupdate(t *testing.T) {
	var fails atomic.Int32
	fails.Store(1)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /giantswarm/v1/kubernetes-version", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte("1.31.1\n")) })
	mux.HandleFunc("GET /giantswarm/v1/sysupdate/kubernetes/{file}", func(w http.ResponseWriter, r *http.Request) {
		switch r.PathValue("file") {
		case "ok.raw":
			if fails.Add(-1) >= 0 {
				http.Error(w, "busy", 503) // retried: nothing was written yet
				return
			}
			w.Write([]byte("0123456789"))
		case "big.raw": // announced too long: refused before reading
			w.Header().Set("Content-Length", "11")
			w.Write([]byte("0123456789a"))
		case "chunked.raw": // no length: cut at the bound
			w.(http.Flusher).Flush()
			w.Write([]byte("0123456789abcdef"))
		default:
			http.NotFound(w, r)
		}
	})
	c, clk := newClient(t, mux)
	ctx := context.Background()
	if v, err := c.KubernetesVersion(ctx); err != nil || v != "1.31.1" {
		t.Errorf("version %q %v", v, err)
	}
	var b strings.Builder
	if n, err := c.SysupdateFile(ctx, "kubernetes", "ok.raw", &b, 10); err != nil || n != 10 || b.String() != "0123456789" || len(clk.slept) != 1 {
		t.Errorf("ok.raw: %d %q %v after %d retries", n, b.String(), err, len(clk.slept))
	}
	for _, f := range []string{"big.raw", "chunked.raw"} {
		var tl *TooLargeError
		if _, err := c.SysupdateFile(ctx, "kubernetes", f, io.Discard, 10); !errors.As(err, &tl) || tl.Max != 10 ||
			err.Error() != "GET /sysupdate/kubernetes/"+f+": larger than the 10-byte bound" {
			t.Errorf("%s: %v", f, err)
		}
	}
	if _, err := c.SysupdateFile(ctx, "kubernetes", "missing.raw", io.Discard, 10); !errors.Is(err, ErrNotFound) {
		t.Errorf("missing: %v", err)
	}
	for _, bad := range [][2]string{{"kubernetes", "../x"}, {"..", "x"}, {"kubernetes", ""}, {"kubernetes", "a?b"}} {
		if _, err := c.SysupdateFile(ctx, bad[0], bad[1], io.Discard, 10); err == nil || !strings.Contains(err.Error(), "bad path element") {
			t.Errorf("%q: %v", bad, err)
		}
	}
}

func TestKubernetesVersionUnset(t *testing.T) {
	c, _ := newClient(t, http.NotFoundHandler())
	if _, err := c.KubernetesVersion(context.Background()); !errors.Is(err, ErrNotFound) {
		t.Errorf("err %v", err)
	}
}
