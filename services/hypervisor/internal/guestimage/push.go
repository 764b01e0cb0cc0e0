package guestimage

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/content/oci"
	"oras.land/oras-go/v2/registry"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/catalog"
)

// Files lists the files of dir that Push publishes: every regular file below
// it (symbolic links to regular files are followed), slash-separated and
// sorted, without MarkerFile.
func Files(dir string) ([]string, error) {
	var files []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		rel = filepath.ToSlash(rel)
		switch {
		case rel == ".":
			return nil
		case d.IsDir():
			return nil
		case rel == MarkerFile:
			return nil
		}
		fi, err := os.Stat(p)
		if err != nil {
			return err
		}
		if !fi.Mode().IsRegular() {
			return fmt.Errorf("%s: not a regular file (%s)", p, fi.Mode().Type())
		}
		files = append(files, rel)
		return nil
	})
	if err != nil {
		return nil, err
	}
	slices.Sort(files)
	return files, nil
}

// target is where Push puts an artifact: a registry's repository, or an
// OCI image layout directory.
type target interface {
	content.Storage
	Tag(ctx context.Context, desc ocispec.Descriptor, reference string) error
}

// Push publishes dir as a guest image artifact under ref, which must carry a
// tag (registry/repository:tag), and returns the manifest digest. Blobs the
// registry already has are not uploaded again. The directory must hold at
// least one catalog image; policy.json is optional.
func Push(ctx context.Context, dir, ref string, opts Options) (string, error) {
	repo, r, err := Repository(ref, opts)
	if err != nil {
		return "", err
	}
	if r.Reference == "" || r.ValidateReferenceAsTag() != nil {
		return "", fmt.Errorf("push %q: needs a tag (registry/repository:tag)", ref)
	}
	return pushTo(ctx, dir, repo, r.Reference, ref, opts)
}

// PushLayout writes dir as a guest image artifact into the OCI image layout
// at layout (made when missing), tagged tag: what make images builds, for a
// release to copy to a registry (oras cp, skopeo) without this binary.
func PushLayout(ctx context.Context, dir, layout, tag string, opts Options) (string, error) {
	if tag == "" || (registry.Reference{Reference: tag}).ValidateReferenceAsTag() != nil {
		return "", fmt.Errorf("push to %s: %q is not a tag", layout, tag)
	}
	store, err := oci.New(layout)
	if err != nil {
		return "", fmt.Errorf("oci layout %s: %w", layout, err)
	}
	return pushTo(ctx, dir, store, tag, layout+":"+tag, opts)
}

func pushTo(ctx context.Context, dir string, repo target, tag, name string, opts Options) (string, error) {
	log := opts.log()
	if fi, err := os.Stat(dir); err != nil {
		return "", err
	} else if !fi.IsDir() {
		return "", fmt.Errorf("%s: not a directory", dir)
	}
	cat, err := catalog.Load(dir, log)
	if err != nil {
		return "", err
	}
	if len(cat.List()) == 0 {
		return "", fmt.Errorf("%s holds no image (<id>_<version>.efi + .raw, or .vmlinuz + .initrd)", dir)
	}
	files, err := Files(dir)
	if err != nil {
		return "", err
	}

	layers := make([]ocispec.Descriptor, len(files))
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(opts.concurrency())
	for i, file := range files {
		g.Go(func() error {
			desc, err := pushFile(gctx, repo, filepath.Join(dir, filepath.FromSlash(file)), file)
			if err != nil {
				return fmt.Errorf("push %s: %w", file, err)
			}
			log.Debug("pushed file", "file", file, "digest", desc.Digest, "size", desc.Size)
			layers[i] = desc
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return "", err
	}
	desc, err := oras.PackManifest(ctx, repo, oras.PackManifestVersion1_1, ArtifactType, oras.PackManifestOptions{
		Layers:              layers,
		ManifestAnnotations: map[string]string{ocispec.AnnotationCreated: Created},
	})
	if err != nil {
		return "", fmt.Errorf("push manifest: %w", err)
	}
	if err := repo.Tag(ctx, desc, tag); err != nil {
		return "", fmt.Errorf("tag %s: %w", tag, err)
	}
	log.Info("pushed guest image", "reference", name, "digest", desc.Digest, "files", len(files))
	return desc.Digest.String(), nil
}

// pushFile uploads one file as a layer unless the registry has its blob.
func pushFile(ctx context.Context, repo target, file, name string) (ocispec.Descriptor, error) {
	f, err := os.Open(file)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return ocispec.Descriptor{}, err
	}
	desc := ocispec.Descriptor{
		MediaType:   FileMediaType,
		Digest:      digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(h.Sum(nil))),
		Size:        n,
		Annotations: map[string]string{ocispec.AnnotationTitle: name},
	}
	if ok, err := repo.Exists(ctx, desc); err == nil && ok {
		return desc, nil
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return ocispec.Descriptor{}, err
	}
	// The target checks the digest: a file changed since it was hashed fails.
	if err := repo.Push(ctx, desc, f); err != nil {
		return ocispec.Descriptor{}, err
	}
	return desc, nil
}
