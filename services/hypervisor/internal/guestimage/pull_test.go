package guestimage

import (
	"bytes"
	"context"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/registry/remote"
)

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
