package guestimage

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"io"
	"io/fs"
	"log"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/go-containerregistry/pkg/registry"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/registry/remote"
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

func TestPushPullRoundTrip(t *testing.T) {
	o := opts(t)
	host := testRegistry(t, nil)
	tree := guestTree("0.1.0", 1)
	ref := host + "/vm-manager-guest-image:0.1.0"
	dgst := push(t, host, "0.1.0", tree, o)
	if !strings.HasPrefix(dgst, "sha256:") {
		t.Fatalf("digest %q", dgst)
	}

	// The digest depends only on the content: a second push, from another
	// directory holding a stale marker, gives the same one.
	again := guestTree("0.1.0", 1)
	again[MarkerFile] = `{"digest":"sha256:stale"}`
	if d := push(t, host, "0.1.0-again", again, o); d != dgst {
		t.Errorf("second push: digest %s, want %s", d, dgst)
	}

	// The manifest as the contract describes it.
	repo, err := remote.NewRepository(ref)
	if err != nil {
		t.Fatal(err)
	}
	repo.PlainHTTP = true
	desc, raw, err := oras.FetchBytes(context.Background(), repo, "0.1.0", oras.DefaultFetchBytesOptions)
	if err != nil {
		t.Fatal(err)
	}
	if desc.Digest.String() != dgst {
		t.Errorf("tag resolves to %s, want %s", desc.Digest, dgst)
	}
	var m ocispec.Manifest
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	if m.ArtifactType != ArtifactType || m.Annotations[ocispec.AnnotationCreated] != Created || m.Config.MediaType != ocispec.MediaTypeEmptyJSON {
		t.Errorf("manifest: artifactType %q, created %q, config %q", m.ArtifactType, m.Annotations[ocispec.AnnotationCreated], m.Config.MediaType)
	}
	var titles []string
	for _, l := range m.Layers {
		if l.MediaType != FileMediaType {
			t.Errorf("layer %s: media type %q", l.Digest, l.MediaType)
		}
		titles = append(titles, l.Annotations[ocispec.AnnotationTitle])
	}
	if want := keys(tree); !reflect.DeepEqual(titles, want) {
		t.Errorf("layer titles %q, want %q", titles, want)
	}

	for _, pullRef := range []string{ref, host + "/vm-manager-guest-image@" + dgst} {
		dst := filepath.Join(t.TempDir(), "state", "images") // parent missing too
		res, err := Pull(context.Background(), pullRef, dst, o)
		if err != nil {
			t.Fatalf("Pull %s: %v", pullRef, err)
		}
		if res.Digest != dgst || res.Unchanged || !reflect.DeepEqual(res.Files, keys(tree)) {
			t.Errorf("Pull %s = %+v", pullRef, res)
		}
		got := readTree(t, dst)
		sameTree(t, pullRef, withoutMarker(got), tree)
		mk, err := ReadMarker(dst)
		if err != nil || mk == nil {
			t.Fatalf("marker: %v %v", mk, err)
		}
		if mk.Reference != pullRef || mk.Digest != dgst || !reflect.DeepEqual(mk.Files, keys(tree)) || mk.PulledAt.IsZero() {
			t.Errorf("marker %+v", mk)
		}
		if fi, err := os.Stat(dst); err != nil || fi.Mode().Perm() != 0o755 {
			t.Errorf("image dir mode: %v %v", fi.Mode(), err)
		}
		// Nothing left beside it.
		if ents, _ := os.ReadDir(filepath.Dir(dst)); len(ents) != 1 {
			t.Errorf("parent holds %v", ents)
		}
	}
}

func TestPullSameDigestIsNoop(t *testing.T) {
	o := opts(t)
	host := testRegistry(t, nil)
	dgst := push(t, host, "0.1.0", guestTree("0.1.0", 1), o)
	ref := host + "/vm-manager-guest-image:0.1.0"
	dst := t.TempDir()
	if _, err := Pull(context.Background(), ref, dst, o); err != nil {
		t.Fatal(err)
	}
	// Golden values recorded after the pull.
	golden := filepath.Join(dst, "test-guest_0.1.0.policy.json")
	if err := os.WriteFile(golden, []byte(`{"pcrs":{"9":"ab"}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	before := readTree(t, dst)
	for _, r := range []string{ref, host + "/vm-manager-guest-image@" + dgst} {
		res, err := Pull(context.Background(), r, dst, o)
		if err != nil {
			t.Fatal(err)
		}
		if !res.Unchanged || res.Digest != dgst {
			t.Errorf("Pull %s again = %+v, want unchanged", r, res)
		}
	}
	sameTree(t, "after the no-op pulls", readTree(t, dst), before)
}

func TestPullNewDigestReplaces(t *testing.T) {
	o := opts(t)
	host := testRegistry(t, nil)
	push(t, host, "0.1.0", guestTree("0.1.0", 1), o)
	v2 := guestTree("0.2.0", 7)
	delete(v2, "policy.json")
	v2["sysupdate/kubernetes/kubernetes_1.34.0.raw"] = "new"
	d2 := push(t, host, "0.2.0", v2, o)

	dst := filepath.Join(t.TempDir(), "images")
	if err := os.Mkdir(dst, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dst, 0o750); err != nil {
		t.Fatal(err)
	}
	if _, err := Pull(context.Background(), host+"/vm-manager-guest-image:0.1.0", dst, o); err != nil {
		t.Fatal(err)
	}
	writeTree(t, dst, map[string]string{"test-guest_0.1.0.policy.json": "{}"})
	res, err := Pull(context.Background(), host+"/vm-manager-guest-image:0.2.0", dst, o)
	if err != nil {
		t.Fatal(err)
	}
	if res.Unchanged || res.Digest != d2 {
		t.Errorf("Pull 0.2.0 = %+v", res)
	}
	got := readTree(t, dst)
	sameTree(t, "after pulling 0.2.0", withoutMarker(got), v2)
	if mk, _ := ReadMarker(dst); mk == nil || mk.Digest != d2 {
		t.Errorf("marker %+v", mk)
	}
	if fi, err := os.Stat(dst); err != nil || fi.Mode().Perm() != 0o750 {
		t.Errorf("the directory's mode is not kept: %v %v", fi.Mode(), err)
	}
	if ents, _ := os.ReadDir(filepath.Dir(dst)); len(ents) != 1 {
		t.Errorf("parent holds %v", ents)
	}
}

// tamper flips one byte of the blob with the given digest on GET.
func tamper(dgst *atomic.Value) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			d, _ := dgst.Load().(string)
			if r.Method == http.MethodGet && d != "" && strings.HasSuffix(r.URL.Path, "/blobs/"+d) {
				w = &flipWriter{ResponseWriter: w}
			}
			next.ServeHTTP(w, r)
		})
	}
}

type flipWriter struct {
	http.ResponseWriter
	done bool
}

func (f *flipWriter) Write(b []byte) (int, error) {
	if !f.done && len(b) > 0 {
		b = bytes.Clone(b)
		b[len(b)/2] ^= 0xff
		f.done = true
	}
	return f.ResponseWriter.Write(b)
}

func TestTamperedBlobRefused(t *testing.T) {
	o := opts(t)
	var target atomic.Value
	host := testRegistry(t, tamper(&target))
	push(t, host, "0.1.0", guestTree("0.1.0", 1), o)
	v2 := guestTree("0.2.0", 9)
	push(t, host, "0.2.0", v2, o)

	dst := filepath.Join(t.TempDir(), "images")
	if _, err := Pull(context.Background(), host+"/vm-manager-guest-image:0.1.0", dst, o); err != nil {
		t.Fatal(err)
	}
	before := readTree(t, dst)

	target.Store(content.NewDescriptorFromBytes("", []byte(v2["test-guest_0.2.0.initrd"])).Digest.String())
	_, err := Pull(context.Background(), host+"/vm-manager-guest-image:0.2.0", dst, o)
	if err == nil {
		t.Fatal("a tampered blob was accepted")
	}
	t.Log(err)
	if !strings.Contains(err.Error(), "test-guest_0.2.0.initrd") || !strings.Contains(err.Error(), "does not match its digest") {
		t.Errorf("error %q does not name the file and the digest mismatch", err)
	}
	sameTree(t, "after the refused pull", readTree(t, dst), before)
	if ents, _ := os.ReadDir(filepath.Dir(dst)); len(ents) != 1 {
		t.Errorf("parent holds %v: the staging directory was left behind", ents)
	}
}

// craft pushes a manifest of the given artifact type with one layer per
// title (content "x"), tagged tag.
func craft(t *testing.T, host, tag, artifactType, mediaType string, titles ...string) {
	t.Helper()
	ctx := context.Background()
	repo, err := remote.NewRepository(host + "/vm-manager-guest-image")
	if err != nil {
		t.Fatal(err)
	}
	repo.PlainHTTP = true
	var layers []ocispec.Descriptor
	for _, title := range titles {
		data := []byte("x " + title)
		desc := content.NewDescriptorFromBytes(mediaType, data)
		desc.Annotations = map[string]string{ocispec.AnnotationTitle: title}
		if err := repo.Push(ctx, desc, bytes.NewReader(data)); err != nil {
			t.Fatal(err)
		}
		layers = append(layers, desc)
	}
	desc, err := oras.PackManifest(ctx, repo, oras.PackManifestVersion1_1, artifactType, oras.PackManifestOptions{Layers: layers})
	if err != nil {
		t.Fatal(err)
	}
	if err := repo.Tag(ctx, desc, tag); err != nil {
		t.Fatal(err)
	}
}

func TestPullRefuses(t *testing.T) {
	o := opts(t)
	host := testRegistry(t, nil)
	push(t, host, "good", guestTree("0.1.0", 1), o)
	craft(t, host, "other-type", "application/vnd.example.other.v1", FileMediaType, "a.vmlinuz")
	craft(t, host, "escape", ArtifactType, FileMediaType, "test-guest_0.1.0.vmlinuz", "../escape")
	craft(t, host, "deep-escape", ArtifactType, FileMediaType, "sysupdate/../../escape")
	craft(t, host, "absolute", ArtifactType, FileMediaType, "/etc/escape")
	craft(t, host, "marker", ArtifactType, FileMediaType, MarkerFile)
	craft(t, host, "layer-type", ArtifactType, "application/octet-stream", "a.vmlinuz")
	craft(t, host, "file-and-dir", ArtifactType, FileMediaType, "sysupdate", "sysupdate/x")

	cases := []struct{ tag, want string }{
		{"other-type", `artifact type "application/vnd.example.other.v1"`},
		{"escape", `"../escape" escapes`},
		{"deep-escape", "escapes"},
		{"absolute", "escapes"},
		{"marker", "reserved"},
		{"layer-type", `media type "application/octet-stream"`},
		{"file-and-dir", "is a file and the directory"},
	}
	root := t.TempDir()
	dst := filepath.Join(root, "images")
	if _, err := Pull(context.Background(), host+"/vm-manager-guest-image:good", dst, o); err != nil {
		t.Fatal(err)
	}
	before := readTree(t, dst)
	for _, c := range cases {
		_, err := Pull(context.Background(), host+"/vm-manager-guest-image:"+c.tag, dst, o)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v, want %q", c.tag, err, c.want)
		}
		sameTree(t, c.tag, readTree(t, dst), before)
	}
	if ents, _ := os.ReadDir(root); len(ents) != 1 {
		t.Errorf("%s holds %v", root, ents)
	}
	// Refused before anything is created.
	fresh := filepath.Join(root, "fresh")
	if _, err := Pull(context.Background(), host+"/vm-manager-guest-image:escape", fresh, o); err == nil {
		t.Error("escape accepted")
	}
	if _, err := os.Stat(fresh); !os.IsNotExist(err) {
		t.Errorf("%s created by a refused pull: %v", fresh, err)
	}
}

func TestPushChecks(t *testing.T) {
	o := opts(t)
	host := testRegistry(t, nil)
	src := t.TempDir()
	writeTree(t, src, guestTree("0.1.0", 1))
	for _, ref := range []string{
		host + "/vm-manager-guest-image",
		host + "/vm-manager-guest-image@sha256:" + strings.Repeat("0", 64),
	} {
		if _, err := Push(context.Background(), src, ref, o); err == nil || !strings.Contains(err.Error(), "needs a tag") {
			t.Errorf("Push %s: err = %v", ref, err)
		}
	}
	empty := t.TempDir()
	writeTree(t, empty, map[string]string{"policy.json": "{}", "lone.vmlinuz": "k"})
	if _, err := Push(context.Background(), empty, host+"/x:1", o); err == nil || !strings.Contains(err.Error(), "holds no image") {
		t.Errorf("Push of a directory without an image: err = %v", err)
	}
	if _, err := Pull(context.Background(), host+"/vm-manager-guest-image", t.TempDir(), o); err == nil || !strings.Contains(err.Error(), "needs a tag or a digest") {
		t.Errorf("Pull without a tag: err = %v", err)
	}
}

// A UKI image without policy.json is a valid artifact too.
func TestUKIWithoutPolicy(t *testing.T) {
	o := opts(t)
	host := testRegistry(t, nil)
	tree := map[string]string{
		"giantswarm-vm-base_0.1.0.efi":             "uki",
		"giantswarm-vm-base_0.1.0.raw":             "disk",
		"giantswarm-vm-base_0.1.0.repart.d/a.conf": "[Partition]\n",
	}
	push(t, host, "uki", tree, o)
	dst := t.TempDir()
	if _, err := Pull(context.Background(), host+"/vm-manager-guest-image:uki", dst, o); err != nil {
		t.Fatal(err)
	}
	sameTree(t, "uki", withoutMarker(readTree(t, dst)), tree)
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

func TestCheckName(t *testing.T) {
	for _, ok := range []string{"a", "a.vmlinuz", "sysupdate/kubernetes/SHA256SUMS", ".hidden", "a..b"} {
		if err := checkName(ok); err != nil {
			t.Errorf("checkName(%q) = %v", ok, err)
		}
	}
	for _, bad := range []string{"", ".", "..", "../x", "a/../../x", "/x", "a//b", "a/./b", "a/", `a\b`, "a\x00b", MarkerFile} {
		if err := checkName(bad); err == nil {
			t.Errorf("checkName(%q) accepted", bad)
		}
	}
}

// replaceContents is the fallback for an image directory that cannot be
// renamed (a mount point).
func TestReplaceContents(t *testing.T) {
	stage, dir := t.TempDir(), t.TempDir()
	writeTree(t, dir, map[string]string{"old": "1", "sub/old": "2"})
	want := map[string]string{"new": "3", "sysupdate/k/x": "4", MarkerFile: "{}"}
	writeTree(t, stage, want)
	if err := replaceContents(stage, dir); err != nil {
		t.Fatal(err)
	}
	sameTree(t, "replaced", readTree(t, dir), want)
	// Across file systems, move copies.
	src := filepath.Join(t.TempDir(), "d")
	writeTree(t, src, map[string]string{"f": "5", "g/h": "6"})
	dst := filepath.Join(t.TempDir(), "d")
	if err := copyFile(filepath.Join(src, "f"), dst+".f", 0o644); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(dst + ".f"); string(b) != "5" {
		t.Errorf("copyFile: %q", b)
	}
}
