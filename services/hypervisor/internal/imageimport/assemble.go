package imageimport

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/ociboot"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/catalog"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/guestimage"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/ociimport"
)

// StagePrefix names an import's staging directory in the image directory
// (the catalog skips directories; Sweep removes what a crash left).
const StagePrefix = ".import-"

// assemble lays the image's files out in stage under their catalog names,
// boots it once to record its golden PCRs, and writes its policy and record.
func (im *Importer) assemble(ctx context.Context, stage, stem, source string, oi *ociimport.Image, boot *hypervisorv1.Image, send Progress) (*hypervisorv1.Image, []byte, error) {
	root, verity, kernel, initrd, cmdline, policy, record := catalog.OCIFiles(stage, stem)
	r, err := ociRoot(oi)
	if err != nil {
		return nil, nil, err
	}
	for _, mv := range [][2]string{{ociimport.RootFile, root}, {ociimport.HashFile, verity}} {
		if err := os.Rename(filepath.Join(stage, "oci", mv[0]), mv[1]); err != nil {
			return nil, nil, err
		}
	}
	// The boot chain's files are the image's own: the kernel image may be
	// replaced later without changing what this image's PCR 9 says.
	for _, cp := range [][2]string{{boot.GetKernel(), kernel}, {boot.GetInitrd(), initrd}} {
		if err := linkOrCopy(cp[0], cp[1]); err != nil {
			return nil, nil, fmt.Errorf("boot chain %s: %w", boot.GetRef(), err)
		}
	}
	line := strings.TrimSpace(boot.GetCmdline() + " " + r.Cmdline())
	if err := os.WriteFile(cmdline, []byte(line+"\n"), 0o644); err != nil {
		return nil, nil, err
	}
	cfg := oi.Config
	rec := catalog.OCIRecord{Reference: source, RootHash: oi.RootHash, Salt: oi.Salt, BootImage: boot.GetRef(),
		Config: ociboot.Config{ManifestDigest: oi.ManifestDigest, ConfigDigest: oi.ConfigDigest,
			Entrypoint: cfg.Entrypoint, Cmd: cfg.Cmd, Env: cfg.Env, WorkingDir: cfg.WorkingDir, User: cfg.User}}
	i := strings.LastIndex(stem, "_")
	img := &hypervisorv1.Image{
		Id: stem[:i], Version: stem[i+1:], Ref: stem, Kind: hypervisorv1.ImageKind_IMAGE_KIND_OCI,
		Kernel: kernel, Initrd: initrd, Cmdline: line,
		Oci: &hypervisorv1.OciSource{Reference: source, ManifestDigest: oi.ManifestDigest, ConfigDigest: oi.ConfigDigest,
			RootHash: oi.RootHash, Root: root, RootVerity: verity, BootImage: boot.GetRef()},
	}
	if err := send(&hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_MEASURING}); err != nil {
		return nil, nil, err
	}
	// Sockets live in the scratch directory: keep its path short.
	scratch, err := os.MkdirTemp("", "vmm-import-measure-")
	if err != nil {
		return nil, nil, err
	}
	defer os.RemoveAll(scratch)
	values, err := im.measurer.Measure(ctx, img, scratch, MeasuredPCRs, im.cfg.MeasureTimeout)
	if err != nil {
		return nil, nil, fmt.Errorf("measuring boot of %s: %w", stem, err)
	}
	doc, err := im.policyDoc(stem, img, values)
	if err != nil {
		return nil, nil, err
	}
	if err := os.WriteFile(policy, doc, 0o644); err != nil {
		return nil, nil, err
	}
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return nil, nil, err
	}
	if err := os.WriteFile(record, append(b, '\n'), 0o644); err != nil {
		return nil, nil, err
	}
	return img, doc, nil
}

// install moves the image's files from stage into dir in OCIFiles' order,
// so the catalog never sees half an image as another one; on an error what
// was moved is removed again.
func install(stage, dir, stem string) error {
	r, v, k, i, c, p, rec := catalog.OCIFiles(stage, stem)
	var moved []string
	for _, from := range []string{r, v, k, i, c, p, rec} {
		to := filepath.Join(dir, filepath.Base(from))
		if err := os.Rename(from, to); err != nil {
			for _, m := range moved {
				os.Remove(m)
			}
			return err
		}
		moved = append(moved, to)
	}
	return nil
}

// Sweep removes what an import that did not finish left in dir: staging
// directories, and the files of a stem with a root but no record.
func Sweep(dir string) (removed []string) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil
	}
	have := map[string]bool{}
	for _, e := range entries {
		have[e.Name()] = true
	}
	for _, e := range entries {
		name := e.Name()
		if e.IsDir() && strings.HasPrefix(name, StagePrefix) {
			if os.RemoveAll(filepath.Join(dir, name)) == nil {
				removed = append(removed, name)
			}
			continue
		}
		stem, ok := strings.CutSuffix(name, ".erofs")
		if !ok {
			continue
		}
		r, v, k, i, c, p, rec := catalog.OCIFiles(dir, stem)
		if have[filepath.Base(rec)] {
			continue
		}
		for _, f := range []string{r, v, k, i, c, p} {
			if err := os.Remove(f); err == nil {
				removed = append(removed, filepath.Base(f))
			}
		}
	}
	return removed
}

// linkOrCopy hard-links src to dst, or copies it across file systems.
func linkOrCopy(src, dst string) error {
	if err := os.Link(src, dst); err == nil {
		return nil
	}
	if err := guestimage.CopyFile(src, dst, 0o644); err != nil {
		os.Remove(dst)
		return err
	}
	return nil
}
