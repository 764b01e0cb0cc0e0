package catalog

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/ociboot"
)

// Files of an imported OCI image, besides the boot chain's .vmlinuz,
// .initrd and .cmdline (whose command line names the root) and its
// .policy.json.
const (
	extOCI    = ".oci.json"
	extErofs  = ".erofs"
	extVerity = ".verity"
)

// maxOCIRecord bounds a .oci.json read (its env and cmd are the image's).
const maxOCIRecord = 1 << 20

// OCIRecord is <stem>.oci.json: where an imported image came from and what
// it runs. The import writes it last, so a stem without it is unfinished.
type OCIRecord struct {
	Reference string `json:"reference"`
	RootHash  string `json:"rootHash"`
	Salt      string `json:"salt"`
	BootImage string `json:"bootImage"`
	// The digests and what the VM runs: the root's own image.json.
	ociboot.Config
}

// OCIFiles are the paths of an OCI image's files in dir, in the order an
// import moves them in: the root first (from then on the stem is no
// kernel image) and the record last (from then on it is an OCI image).
func OCIFiles(dir, stem string) (root, verity, kernel, initrd, cmdline, policy, record string) {
	p := func(ext string) string { return filepath.Join(dir, stem+ext) }
	return p(extErofs), p(extVerity), p(extKernel), p(extInitrd), p(extCmdline), p(extPolicy), p(extOCI)
}

// oci completes img, a kernel image of the same stem, as an OCI image, or
// says why it is not one.
func (c *Catalog) oci(img *hypervisorv1.Image, f *stemFiles) error {
	if !f.oci || !f.erofs || !f.verity || !f.cmdline {
		return fmt.Errorf("an unfinished import: it needs %s, %s, %s and %s", extOCI, extErofs, extVerity, extCmdline)
	}
	root, verity, _, _, _, _, record := OCIFiles(c.dir, img.Ref)
	b, err := readBounded(record, maxOCIRecord)
	if err != nil {
		return err
	}
	var r OCIRecord
	if err := json.Unmarshal(b, &r); err != nil {
		return fmt.Errorf("%s: %w", record, err)
	}
	var stored int64
	for _, p := range []string{root, verity} {
		fi, err := os.Stat(p)
		if err != nil {
			return err
		}
		stored += fi.Size()
	}
	img.Kind = hypervisorv1.ImageKind_IMAGE_KIND_OCI
	img.Oci = &hypervisorv1.OciSource{
		Reference: r.Reference, ManifestDigest: r.ManifestDigest, ConfigDigest: r.ConfigDigest,
		RootHash: r.RootHash, Root: root, RootVerity: verity, StoredBytes: stored,
		Entrypoint: r.Entrypoint, Cmd: r.Cmd, Env: r.Env, WorkingDir: r.WorkingDir, User: r.User,
		BootImage: r.BootImage,
	}
	return nil
}

func readBounded(path string, max int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if fi.Size() > max {
		return nil, fmt.Errorf("%s is %d bytes, over %d", path, fi.Size(), max)
	}
	b := make([]byte, fi.Size())
	_, err = f.ReadAt(b, 0)
	return b, err
}
