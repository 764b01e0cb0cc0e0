package guestimage

import (
	"context"
	"encoding/base64"
	"io"
	"io/fs"
	"log"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/go-containerregistry/pkg/registry"
)

// testRegistry serves an in-memory OCI registry over plain HTTP on loopback;
// wrap (optional) sits in front of it. It returns host:port.
func testRegistry(t *testing.T, wrap func(http.Handler) http.Handler) string {
	t.Helper()
	var h http.Handler = registry.New(registry.Logger(log.New(io.Discard, "", 0)))
	if wrap != nil {
		h = wrap(h)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// opts isolates the test from the user's Docker config: an empty one.
func opts(t *testing.T) Options {
	t.Helper()
	t.Setenv("DOCKER_CONFIG", t.TempDir())
	return Options{PlainHTTP: true}
}

func random(seed uint64, n int) string {
	r := rand.New(rand.NewPCG(seed, seed))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return string(b)
}

// guestTree is an image directory: a direct-kernel image, a shared policy and
// a sysupdate tree.
func guestTree(version string, seed uint64) map[string]string {
	stem := "test-guest_" + version
	return map[string]string{
		stem + ".vmlinuz":                            "MZ" + random(seed, 256<<10),
		stem + ".initrd":                             random(seed+1, 128<<10),
		stem + ".cmdline":                            "console=ttyS0 panic=-1\n",
		"policy.json":                                `{"image_id":"test-guest","pcrs":{}}` + "\n",
		"sysupdate/kubernetes/SHA256SUMS":            "0000  kubernetes_1.33.1.raw\n",
		"sysupdate/kubernetes/kubernetes_1.33.1.raw": random(seed+2, 64<<10),
	}
}

func writeTree(t *testing.T, dir string, files map[string]string) {
	t.Helper()
	for name, data := range files {
		p := filepath.Join(dir, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// readTree reads every regular file below dir, the marker included.
func readTree(t *testing.T, dir string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		b, err := os.ReadFile(p)
		out[filepath.ToSlash(rel)] = string(b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func withoutMarker(m map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range m {
		if k != MarkerFile {
			out[k] = v
		}
	}
	return out
}

func sameTree(t *testing.T, what string, got, want map[string]string) {
	t.Helper()
	var names []string
	for k := range want {
		names = append(names, k)
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			names = append(names, k)
		}
	}
	slices.Sort(names)
	for _, k := range names {
		g, gok := got[k]
		w, wok := want[k]
		switch {
		case !gok:
			t.Errorf("%s: %s missing", what, k)
		case !wok:
			t.Errorf("%s: unexpected %s", what, k)
		case g != w:
			t.Errorf("%s: %s differs (%d bytes, want %d)", what, k, len(g), len(w))
		}
	}
}

func keys(m map[string]string) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func push(t *testing.T, host, tag string, files map[string]string, o Options) string {
	t.Helper()
	src := t.TempDir()
	writeTree(t, src, files)
	d, err := Push(context.Background(), src, host+"/vm-manager-guest-image:"+tag, o)
	if err != nil {
		t.Fatalf("Push: %v", err)
	}
	return d
}

// Credentials come from $DOCKER_CONFIG/config.json.
func TestDockerConfigCredentials(t *testing.T) {
	var anonymous atomic.Int32
	host := testRegistry(t, func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if u, p, ok := r.BasicAuth(); !ok || u != "robot" || p != "s3cret" {
				anonymous.Add(1)
				w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
				http.Error(w, "unauthorized", http.StatusUnauthorized)
				return
			}
			next.ServeHTTP(w, r)
		})
	})
	src := t.TempDir()
	writeTree(t, src, guestTree("0.1.0", 1))
	ref := host + "/vm-manager-guest-image:0.1.0"

	t.Setenv("DOCKER_CONFIG", t.TempDir())
	if _, err := Push(context.Background(), src, ref, Options{PlainHTTP: true}); err == nil {
		t.Fatal("anonymous push accepted")
	}

	cfg := t.TempDir()
	auth := base64.StdEncoding.EncodeToString([]byte("robot:s3cret"))
	writeTree(t, cfg, map[string]string{"config.json": `{"auths":{"` + host + `":{"auth":"` + auth + `"}}}`})
	t.Setenv("DOCKER_CONFIG", cfg)
	o := Options{PlainHTTP: true}
	dgst, err := Push(context.Background(), src, ref, o)
	if err != nil {
		t.Fatal(err)
	}
	res, err := Pull(context.Background(), ref, t.TempDir(), o)
	if err != nil || res.Digest != dgst {
		t.Fatalf("Pull = %+v, %v", res, err)
	}
}
