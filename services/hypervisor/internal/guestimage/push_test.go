package guestimage

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/content/oci"
	"oras.land/oras-go/v2/registry/remote"
)

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

// An OCI layout written by PushLayout holds the same artifact as a registry
// push (one digest), and copied into a registry as it is, it pulls.
func TestPushLayout(t *testing.T) {
	o := opts(t)
	host := testRegistry(t, nil)
	tree := guestTree("0.1.0", 3)
	dir := t.TempDir()
	writeTree(t, dir, tree)
	layout := filepath.Join(t.TempDir(), "guest-image")
	dgst, err := PushLayout(context.Background(), dir, layout, "0.1.0", o)
	if err != nil {
		t.Fatal(err)
	}
	if want := push(t, host, "0.1.0", tree, o); dgst != want {
		t.Errorf("layout digest %s, registry push %s", dgst, want)
	}
	if _, err := os.Stat(filepath.Join(layout, "oci-layout")); err != nil {
		t.Errorf("no oci-layout file: %v", err)
	}
	src, err := oci.New(layout)
	if err != nil {
		t.Fatal(err)
	}
	ref := host + "/copied:0.1.0"
	repo, err := remote.NewRepository(ref)
	if err != nil {
		t.Fatal(err)
	}
	repo.PlainHTTP = true
	if _, err := oras.Copy(context.Background(), src, "0.1.0", repo, "0.1.0", oras.DefaultCopyOptions); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(t.TempDir(), "images")
	res, err := Pull(context.Background(), ref, dst, o)
	if err != nil || res.Digest != dgst {
		t.Fatalf("pull of the copy: %+v, %v", res, err)
	}
	sameTree(t, "pulled copy", withoutMarker(readTree(t, dst)), tree)

	if _, err := PushLayout(context.Background(), dir, layout, "no/tag", o); err == nil || !strings.Contains(err.Error(), "is not a tag") {
		t.Errorf("a bad tag: %v", err)
	}
}
