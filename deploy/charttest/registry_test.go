package charttest

import (
	"bytes"
	"io"
	"io/fs"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/registry"
)

// testRegistry is an OCI registry on loopback (go-containerregistry's
// in-memory one), as a lab registry the chart reaches with plainHTTP.
func testRegistry(t *testing.T) string {
	t.Helper()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// publishedTree is what the release publishes: the test guests `make
// guest-image` built (the direct-kernel one, and the UKI one with its policy
// and the sysupdate tree), as symlinks into the image directory. The UKI
// image is required on CI, where make test builds it.
func publishedTree(t *testing.T, images string) string {
	t.Helper()
	dir := t.TempDir()
	var files []string
	for _, pattern := range []string{"test-guest_*", "test-guest-uki_*", "sysupdate/kubernetes/*"} {
		m, _ := filepath.Glob(filepath.Join(images, pattern))
		files = append(files, m...)
	}
	if !slices.ContainsFunc(files, func(f string) bool { return strings.HasSuffix(f, ".efi") }) {
		if os.Getenv("CI") == "true" {
			t.Fatalf("no UKI test guest in %s: make guest-image builds it", images)
		}
		t.Logf("no UKI test guest in %s: publishing the direct-kernel one only", images)
	}
	for _, f := range files {
		rel, _ := filepath.Rel(images, f)
		dst := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(f, dst); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// sameTree fails unless got holds exactly want's files (the pull marker
// aside), byte for byte.
func sameTree(t *testing.T, want, got string) {
	t.Helper()
	list := func(root string) []string {
		var out []string
		err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() {
				return err
			}
			rel, _ := filepath.Rel(root, p)
			if rel != ".guest-image.json" {
				out = append(out, rel)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	w, g := list(want), list(got)
	if !slices.Equal(w, g) {
		t.Fatalf("pulled files %q, published %q", g, w)
	}
	for _, rel := range w {
		a, err := os.ReadFile(filepath.Join(want, rel))
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(filepath.Join(got, rel))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(a, b) {
			t.Errorf("%s differs after the pull (%d bytes published, %d pulled)", rel, len(a), len(b))
		}
	}
}

// run runs a command and fails the test with its output unless it succeeds.
func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}
