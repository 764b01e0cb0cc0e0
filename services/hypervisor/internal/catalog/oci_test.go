package catalog

import (
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/ociboot"
)

// An imported image is an OCI image with its source; half of one (an import
// that did not finish) is no image at all, and never a plain kernel image
// that would boot without its root.
func TestOCIImages(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	rec, _ := json.Marshal(OCIRecord{Reference: "localhost:5000/py:1", RootHash: "bb", BootImage: "test-guest_0.1.0",
		Config: ociboot.Config{ManifestDigest: "sha256:aa", Cmd: []string{"python3"}, User: "1000"}})
	for _, stem := range []string{"py_1", "half_1"} {
		write(stem+".vmlinuz", "k")
		write(stem+".initrd", "i")
		write(stem+".cmdline", "console=ttyS0 vmm.oci.roothash=bb")
		write(stem+".erofs", "root")
		write(stem+".verity", "tree")
	}
	write("py_1.oci.json", string(rec))
	c, err := Load(dir, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	img, err := c.Get("py")
	if err != nil {
		t.Fatal(err)
	}
	o := img.GetOci()
	if img.GetKind() != hypervisorv1.ImageKind_IMAGE_KIND_OCI || o.GetReference() != "localhost:5000/py:1" || o.GetStoredBytes() != 8 ||
		o.GetRoot() != filepath.Join(dir, "py_1.erofs") || o.GetUser() != "1000" || img.GetCmdline() != "console=ttyS0 vmm.oci.roothash=bb" {
		t.Errorf("py_1: %v", img)
	}
	if _, err := c.Get("half"); err == nil {
		t.Error("an unfinished import is offered")
	}
	write("half_1.oci.json", "{not json")
	c.Refresh()
	if _, err := c.Get("half"); err == nil {
		t.Error("an image with an unreadable record is offered")
	}
}
