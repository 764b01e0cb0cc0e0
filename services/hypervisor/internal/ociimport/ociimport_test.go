package ociimport

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/content/oci"

	"github.com/giantswarm/vm-manager/pkg/verity"
	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// gzLayer is a tar+gzip layer of name→content files.
func gzLayer(t *testing.T, files ...[2]string) []byte {
	t.Helper()
	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	for _, f := range files {
		if err := tw.WriteHeader(&tar.Header{Name: f[0], Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(f[1]))}); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(f[1]))
	}
	tw.Close()
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(tb.Bytes())
	zw.Close()
	return gz.Bytes()
}

// layout writes an OCI layout holding one image tagged tag, from layers.
func layout(t *testing.T, tag string, layers ...[]byte) *oci.Store {
	t.Helper()
	ctx := context.Background()
	st, err := oci.New(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	push := func(mediaType string, b []byte) ocispec.Descriptor {
		d := ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(b), Size: int64(len(b))}
		if err := st.Push(ctx, d, bytes.NewReader(b)); err != nil {
			t.Fatal(err)
		}
		return d
	}
	var descs []ocispec.Descriptor
	var diffIDs []digest.Digest
	for _, l := range layers {
		descs = append(descs, push(ocispec.MediaTypeImageLayerGzip, l))
		diffIDs = append(diffIDs, digest.FromBytes(l)) // not checked by the import
	}
	cfg, _ := json.Marshal(ocispec.Image{Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"},
		Config: ocispec.ImageConfig{Entrypoint: []string{"/usr/bin/python3"}, Cmd: []string{"-c", "print(6*7)"}, Env: []string{"A=1"}, User: "1000", WorkingDir: "/app"},
		RootFS: ocispec.RootFS{Type: "layers", DiffIDs: diffIDs}})
	cdesc := push(ocispec.MediaTypeImageConfig, cfg)
	m, err := oras.PackManifest(ctx, st, oras.PackManifestVersion1_1, "", oras.PackManifestOptions{ConfigDescriptor: &cdesc, Layers: descs})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Tag(ctx, m, tag); err != nil {
		t.Fatal(err)
	}
	return st
}

func needRoot(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("mkfs.erofs is missing (erofs-utils; make deps installs it)")
		}
		t.Skip("mkfs.erofs is missing (erofs-utils)")
	}
	if os.Geteuid() != 0 {
		t.Skip("the root's owners are kept only by root: run as root")
	}
}

// An image becomes root.erofs, root.verity and image.json naming its source,
// its config and the root hash of what was written.
func TestImportFromLayout(t *testing.T) {
	needRoot(t)
	st := layout(t, "py:1", gzLayer(t, [2]string{"etc/os-release", "ID=test\n"}), gzLayer(t, [2]string{"app/main.py", "print(6*7)\n"}))
	dir := filepath.Join(t.TempDir(), "img")
	img, err := Import(context.Background(), st, "py:1", dir, Options{})
	if err != nil {
		t.Fatal(err)
	}
	desc, _ := st.Resolve(context.Background(), "py:1")
	if img.Reference != "py:1" || img.ManifestDigest != desc.Digest.String() || img.ConfigDigest == "" {
		t.Errorf("source %+v, manifest %s", img, desc.Digest)
	}
	if c := img.Config; c.User != "1000" || c.WorkingDir != "/app" || len(c.Entrypoint) != 1 || c.Env[0] != "A=1" {
		t.Errorf("config %+v", c)
	}
	// The recorded root hash is the verity root of the root written.
	root, err := os.ReadFile(filepath.Join(dir, RootFile))
	if err != nil {
		t.Fatal(err)
	}
	salt, _ := hex.DecodeString(img.Salt)
	var hash bytes.Buffer
	sum, err := verity.Format(bytes.NewReader(root), int64(len(root)), &hash, verity.Params{Salt: salt})
	if err != nil || hex.EncodeToString(sum) != img.RootHash {
		t.Errorf("root hash %s, the root's %x (%v)", img.RootHash, sum, err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, HashFile)); !bytes.Equal(b, hash.Bytes()) {
		t.Error("root.verity is not the root's hash device")
	}
	var saved Image
	if b, err := os.ReadFile(filepath.Join(dir, ConfigFile)); err != nil || json.Unmarshal(b, &saved) != nil || saved.RootHash != img.RootHash {
		t.Errorf("image.json: %v %+v", err, saved)
	}
	if _, err := os.Stat(filepath.Join(dir, "root.tar")); err == nil {
		t.Error("the flattened tar was left behind")
	}
	// The same image again: the same root hash (reproducible).
	again, err := Import(context.Background(), st, "py:1", filepath.Join(t.TempDir(), "img"), Options{})
	if err != nil || again.RootHash != img.RootHash {
		t.Errorf("a second import: %v, root hash %s then %s", err, img.RootHash, again.RootHash)
	}
}

// A hostile layer is refused, naming it, and leaves no directory.
func TestImportRefusesAndLeavesNothing(t *testing.T) {
	needRoot(t)
	st := layout(t, "bad", gzLayer(t, [2]string{"../../etc/cron.d/x", "boom"}))
	dir := filepath.Join(t.TempDir(), "img")
	_, err := Import(context.Background(), st, "bad", dir, Options{})
	if apierr.CodeOf(err) != apierr.InvalidRequest {
		t.Fatalf("%v, want invalid_request", err)
	}
	if _, serr := os.Stat(dir); serr == nil {
		t.Error("the refused import left its directory")
	}
	if _, err := Import(context.Background(), st, "missing", dir, Options{}); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("an unknown reference: %v", err)
	}
}
