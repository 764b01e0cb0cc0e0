package imageimport

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/hex"
	"encoding/json"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/content/oci"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/ociboot"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/catalog"
)

func needTools(t *testing.T) {
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

type entry struct {
	name, body string
	typ        byte
}

func gzLayer(t *testing.T, entries ...entry) []byte {
	t.Helper()
	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: 0o644, Size: int64(len(e.body))}
		if e.typ == 0 {
			h.Typeflag = tar.TypeReg
		}
		if h.Typeflag != tar.TypeReg {
			h.Size = 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		tw.Write([]byte(e.body))
	}
	tw.Close()
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(tb.Bytes())
	zw.Close()
	return gz.Bytes()
}

// layout writes an OCI layout directory holding one image tagged tag.
func layout(t *testing.T, dir, tag string, layers ...[]byte) {
	t.Helper()
	ctx := context.Background()
	st, err := oci.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	push := func(mediaType string, b []byte) ocispec.Descriptor {
		d := ocispec.Descriptor{MediaType: mediaType, Digest: digest.FromBytes(b), Size: int64(len(b))}
		if err := st.Push(ctx, d, bytes.NewReader(b)); err != nil && !strings.Contains(err.Error(), "already exists") {
			t.Fatal(err)
		}
		return d
	}
	var descs []ocispec.Descriptor
	for _, l := range layers {
		descs = append(descs, push(ocispec.MediaTypeImageLayerGzip, l))
	}
	cfg, _ := json.Marshal(ocispec.Image{Platform: ocispec.Platform{OS: "linux", Architecture: "amd64"},
		Config: ocispec.ImageConfig{Cmd: []string{"/bin/app"}, Env: []string{"A=1"}, User: "1000", WorkingDir: "/app"}})
	cdesc := push(ocispec.MediaTypeImageConfig, cfg)
	m, err := oras.PackManifest(ctx, st, oras.PackManifestVersion1_1, "", oras.PackManifestOptions{ConfigDescriptor: &cdesc, Layers: descs})
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Tag(ctx, m, tag); err != nil {
		t.Fatal(err)
	}
}

// fakeMeasurer records what it was asked to boot.
type fakeMeasurer struct {
	mu    sync.Mutex
	seen  []*hypervisorv1.Image
	block chan struct{} // when set, Measure waits for it or ctx
}

func (f *fakeMeasurer) Measure(ctx context.Context, img *hypervisorv1.Image, dir string, pcrs []uint, _ time.Duration) (map[uint32][]byte, error) {
	f.mu.Lock()
	f.seen = append(f.seen, img)
	f.mu.Unlock()
	for _, p := range []string{img.GetKernel(), img.GetInitrd(), img.GetOci().GetRoot(), img.GetOci().GetRootVerity()} {
		if _, err := os.Stat(p); err != nil {
			return nil, err
		}
	}
	if f.block != nil {
		select {
		case <-f.block:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	out := map[uint32][]byte{}
	for _, p := range pcrs {
		out[uint32(p)] = bytes.Repeat([]byte{byte(p)}, 32)
	}
	return out, nil
}

type fakePolicies struct {
	mu   sync.Mutex
	docs map[string][]byte
}

func (f *fakePolicies) Sync(_ context.Context, ref string, doc []byte) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.docs == nil {
		f.docs = map[string][]byte{}
	}
	f.docs[ref] = doc
	return nil
}

type fixture struct {
	dir      string
	cat      *catalog.Catalog
	measurer *fakeMeasurer
	policies *fakePolicies
	im       *Importer
}

// newFixture is an image directory with a kernel image to boot OCI images.
func newFixture(t *testing.T, cfg Config) *fixture {
	t.Helper()
	dir := t.TempDir()
	for ext, body := range map[string]string{".vmlinuz": "kernel", ".initrd": "initrd", ".cmdline": "console=ttyS0 panic=-1\n"} {
		if err := os.WriteFile(filepath.Join(dir, "test-guest_0.1.0"+ext), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cat, err := catalog.Load(dir, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{dir: dir, cat: cat, measurer: &fakeMeasurer{}, policies: &fakePolicies{}}
	f.im = New(cfg, cat, f.measurer, f.policies, slog.New(slog.DiscardHandler))
	return f
}

// dirNames are the image directory's entries but the boot image's.
func (f *fixture) dirNames(t *testing.T) []string {
	t.Helper()
	es, err := os.ReadDir(f.dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range es {
		if !strings.HasPrefix(e.Name(), "test-guest_") {
			out = append(out, e.Name())
		}
	}
	return out
}

func TestImportLayout(t *testing.T) {
	needTools(t)
	f := newFixture(t, Config{})
	src := filepath.Join(t.TempDir(), "app")
	layout(t, src, "v1", gzLayer(t, entry{name: "bin/app", body: "#!/bin/sh\necho hi\n"}))

	var phases []hypervisorv1.ImportPhase
	res, err := f.im.Import(context.Background(), &hypervisorv1.ImportImageRequest{Source: LayoutPrefix + src + ":v1"}, func(p *hypervisorv1.ImportImageResponse) error {
		if len(phases) == 0 || phases[len(phases)-1] != p.GetPhase() {
			phases = append(phases, p.GetPhase())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []hypervisorv1.ImportPhase{hypervisorv1.ImportPhase_IMPORT_PHASE_RESOLVING, hypervisorv1.ImportPhase_IMPORT_PHASE_ROOT, hypervisorv1.ImportPhase_IMPORT_PHASE_MEASURING}
	if !slices.Equal(slices.DeleteFunc(phases, func(p hypervisorv1.ImportPhase) bool { return p == hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS }), want) {
		t.Errorf("phases %v, want %v (LAYERS aside: a tiny layer may report none)", phases, want)
	}
	img := res.GetImage()
	if res.GetPhase() != hypervisorv1.ImportPhase_IMPORT_PHASE_DONE || img.GetRef() != "app_v1" || img.GetKind() != hypervisorv1.ImageKind_IMAGE_KIND_OCI {
		t.Fatalf("result %v", res)
	}
	o := img.GetOci()
	if !strings.HasPrefix(o.GetManifestDigest(), "sha256:") || len(o.GetRootHash()) != 64 || o.GetStoredBytes() == 0 ||
		!slices.Equal(o.GetCmd(), []string{"/bin/app"}) || o.GetUser() != "1000" || o.GetBootImage() != "test-guest_0.1.0" {
		t.Errorf("oci source %v", o)
	}
	root, ok, err := ociboot.ParseCmdline(img.GetCmdline())
	if !ok || err != nil || strings.ToLower(o.GetRootHash()) != hex.EncodeToString(root.RootHash) || !strings.HasPrefix(img.GetCmdline(), "console=ttyS0 panic=-1 ") {
		t.Errorf("command line %q: %v %v", img.GetCmdline(), ok, err)
	}
	// What was measured is what the catalog offers.
	if len(f.measurer.seen) != 1 || f.measurer.seen[0].GetCmdline() != img.GetCmdline() {
		t.Errorf("measured %v", f.measurer.seen)
	}
	var doc struct {
		ImageID string                       `json:"image_id"`
		Golden  map[string]map[string]string `json:"golden"`
		OCI     map[string]string            `json:"oci"`
	}
	if err := json.Unmarshal(f.policies.docs["app_v1"], &doc); err != nil {
		t.Fatal(err)
	}
	if doc.ImageID != "app" || doc.OCI["root_hash"] != o.GetRootHash() || doc.OCI["manifest_digest"] != o.GetManifestDigest() || len(doc.Golden["sha256"]) != len(MeasuredPCRs) {
		t.Errorf("policy %+v", doc)
	}
	if got, _ := f.cat.PolicyDocument("app_v1"); !bytes.Equal(got, f.policies.docs["app_v1"]) {
		t.Error("the catalog's policy is not the one handed to attestation")
	}

	// The same manifest again: unchanged, nothing measured.
	res, err = f.im.Import(context.Background(), &hypervisorv1.ImportImageRequest{Source: LayoutPrefix + src + ":v1"}, nil)
	if err != nil || !res.GetUnchanged() || len(f.measurer.seen) != 1 {
		t.Fatalf("second import: %v %v (measured %d)", res, err, len(f.measurer.seen))
	}
	// Other content under the same tag: conflict, naming both digests.
	layout(t, src, "v1", gzLayer(t, entry{name: "bin/app", body: "other\n"}))
	before := f.dirNames(t)
	_, err = f.im.Import(context.Background(), &hypervisorv1.ImportImageRequest{Source: LayoutPrefix + src + ":v1"}, nil)
	if apierr.CodeOf(err) != apierr.Conflict || !strings.Contains(err.Error(), o.GetManifestDigest()) {
		t.Fatalf("re-tagged import: %v", err)
	}
	if after := f.dirNames(t); !slices.Equal(before, after) {
		t.Errorf("a refused import changed the directory: %v, then %v", before, after)
	}
}

// A hostile layer is refused naming the layer and the entry; nothing is left.
func TestImportHostileLeavesNothing(t *testing.T) {
	needTools(t)
	for name, layer := range map[string][]entry{
		"traversal":      {{name: "../../etc/passwd", body: "x"}},
		"device node":    {{name: "dev/sda", typ: tar.TypeBlock}},
		"absolute climb": {{name: "a/../../b", body: "x"}},
	} {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t, Config{})
			src := filepath.Join(t.TempDir(), "bad")
			l := gzLayer(t, layer...)
			layout(t, src, "v1", l)
			_, err := f.im.Import(context.Background(), &hypervisorv1.ImportImageRequest{Source: LayoutPrefix + src + ":v1"}, nil)
			if apierr.CodeOf(err) != apierr.InvalidRequest || !strings.Contains(err.Error(), digest.FromBytes(l).String()) || !strings.Contains(err.Error(), layer[0].name) {
				t.Fatalf("import: %v; want invalid_request naming the layer and %q", err, layer[0].name)
			}
			if left := f.dirNames(t); len(left) != 0 {
				t.Errorf("left behind: %v", left)
			}
			if len(f.measurer.seen) != 0 {
				t.Error("a refused image was booted")
			}
		})
	}
}

// The bounds: one image's size, and the store's quota; each refusal counted.
func TestImportBounds(t *testing.T) {
	needTools(t)
	big := gzLayer(t, entry{name: "blob", body: strings.Repeat("x", 3<<20)})
	src := filepath.Join(t.TempDir(), "big")
	layout(t, src, "v1", big)

	f := newFixture(t, Config{MaxImageBytes: 1 << 20})
	_, err := f.im.Import(context.Background(), &hypervisorv1.ImportImageRequest{Source: LayoutPrefix + src + ":v1"}, nil)
	if apierr.CodeOf(err) != apierr.ResourceExhausted {
		t.Fatalf("over --max-image-bytes: %v", err)
	}
	if n, _ := f.im.Refusals(); n != 1 {
		t.Errorf("image-bytes refusals %d, want 1", n)
	}

	f = newFixture(t, Config{StoreQuota: 1 << 20})
	_, err = f.im.Import(context.Background(), &hypervisorv1.ImportImageRequest{Source: LayoutPrefix + src + ":v1"}, nil)
	if apierr.CodeOf(err) != apierr.ResourceExhausted || !strings.Contains(err.Error(), "--image-store-bytes") {
		t.Fatalf("over the store quota: %v", err)
	}
	if _, n := f.im.Refusals(); n != 1 {
		t.Errorf("store refusals %d, want 1", n)
	}
	if left := f.dirNames(t); len(left) != 0 {
		t.Errorf("left behind: %v", left)
	}
}

// A cancelled import leaves nothing, whatever step it was in.
func TestImportCancelLeavesNothing(t *testing.T) {
	needTools(t)
	f := newFixture(t, Config{})
	f.measurer.block = make(chan struct{})
	src := filepath.Join(t.TempDir(), "app")
	layout(t, src, "v1", gzLayer(t, entry{name: "bin/app", body: "x"}))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := f.im.Import(ctx, &hypervisorv1.ImportImageRequest{Source: LayoutPrefix + src + ":v1"}, func(p *hypervisorv1.ImportImageResponse) error {
			if p.GetPhase() == hypervisorv1.ImportPhase_IMPORT_PHASE_MEASURING {
				cancel() // the measuring boot is under way
			}
			return nil
		})
		done <- err
	}()
	select {
	case err := <-done:
		if err == nil || apierr.CodeOf(err) != apierr.Timeout {
			t.Fatalf("cancelled import: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("a cancelled import did not end")
	}
	if left := f.dirNames(t); len(left) != 0 {
		t.Errorf("left behind: %v", left)
	}
	if _, err := f.cat.Get("app"); err == nil {
		t.Error("the catalog offers a cancelled import")
	}
}

func TestSweep(t *testing.T) {
	dir := t.TempDir()
	for _, name := range []string{"a_1.erofs", "a_1.verity", "a_1.vmlinuz", "b_1.erofs", "b_1.oci.json", "k_1.vmlinuz"} {
		os.WriteFile(filepath.Join(dir, name), nil, 0o644)
	}
	os.MkdirAll(filepath.Join(dir, StagePrefix+"123", "oci"), 0o755)
	removed := Sweep(dir)
	slices.Sort(removed)
	if want := []string{StagePrefix + "123", "a_1.erofs", "a_1.verity", "a_1.vmlinuz"}; !slices.Equal(removed, want) {
		t.Errorf("removed %v, want %v", removed, want)
	}
}

func TestParseSource(t *testing.T) {
	for in, want := range map[string]source{
		"localhost:5000/team/python:3.12": {tag: "3.12", name: "python"},
		"oci-layout:/srv/img:v2":          {layout: "/srv/img", tag: "v2", name: "img"},
		"oci-layout:/srv/img":             {layout: "/srv/img", tag: "latest", name: "img"},
	} {
		got, err := parseSource(in)
		if err != nil || got.layout != want.layout || got.tag != want.tag || got.name != want.name {
			t.Errorf("%s: %+v %v", in, got, err)
		}
	}
	for _, bad := range []string{"", "oci-layout:relative", "no spaces/x y", "localhost:5000/Repo:1"} {
		if _, err := parseSource(bad); apierr.CodeOf(err) != apierr.InvalidRequest {
			t.Errorf("%q: %v, want invalid_request", bad, err)
		}
	}
	if !loopback("localhost:5000") || !loopback("127.0.0.1:80") || !loopback("[::1]:5000") || loopback("registry.example:5000") {
		t.Error("loopback")
	}
}
