package guestimage

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/registry/remote"
)

// Marker is the content of MarkerFile.
type Marker struct {
	Reference string    `json:"reference"`
	Digest    string    `json:"digest"`
	Files     []string  `json:"files"`
	PulledAt  time.Time `json:"pulledAt"`
}

// Result describes a pull.
type Result struct {
	// Reference is the reference as given, Digest the manifest's digest.
	Reference string
	Digest    string
	// Files are the artifact's files, slash-separated, sorted.
	Files []string
	// Unchanged is true when the marker already held Digest: nothing was
	// downloaded and the directory was left alone.
	Unchanged bool
}

// ReadMarker reads dir's MarkerFile; a missing marker is (nil, nil).
func ReadMarker(dir string) (*Marker, error) {
	b, err := os.ReadFile(filepath.Join(dir, MarkerFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var m Marker
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("%s: %w", filepath.Join(dir, MarkerFile), err)
	}
	return &m, nil
}

// Pull installs the guest image artifact ref (registry/repository:tag or
// registry/repository@sha256:…) into dir, which is created if missing.
//
// It refuses manifests of another artifact type, layers of another media type
// and layer names that are not plain relative paths inside dir. When dir's
// marker already records the manifest's digest nothing is downloaded.
// Otherwise every blob is downloaded (DefaultConcurrency at once) into a
// staging directory beside dir and verified against its digest; then the
// staging directory, with a new marker, replaces dir: whatever dir held
// before is gone. On any error dir is left as it was.
func Pull(ctx context.Context, ref, dir string, opts Options) (Result, error) {
	log := opts.log()
	res := Result{Reference: ref}
	repo, r, err := Repository(ref, opts)
	if err != nil {
		return res, err
	}
	if r.Reference == "" {
		return res, fmt.Errorf("pull %q: needs a tag or a digest", ref)
	}
	desc, raw, err := oras.FetchBytes(ctx, repo, r.Reference, oras.FetchBytesOptions{MaxBytes: maxManifestBytes})
	if err != nil {
		return res, fmt.Errorf("fetch manifest %s: %w", ref, err)
	}
	res.Digest = desc.Digest.String()
	layers, err := checkManifest(desc, raw)
	if err != nil {
		return res, fmt.Errorf("%s (%s): %w", ref, desc.Digest, err)
	}
	for _, l := range layers {
		res.Files = append(res.Files, l.Annotations[ocispec.AnnotationTitle])
	}
	slices.Sort(res.Files)

	dir, err = resolveDir(dir)
	if err != nil {
		return res, err
	}
	if m, err := ReadMarker(dir); err != nil {
		log.Warn("unreadable marker; pulling again", "err", err)
	} else if m != nil && m.Digest == res.Digest {
		log.Info("guest image already present", "reference", ref, "digest", res.Digest, "dir", dir)
		res.Unchanged = true
		return res, nil
	}

	parent := filepath.Dir(dir)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return res, err
	}
	stage, err := os.MkdirTemp(parent, "."+filepath.Base(dir)+".pull-")
	if err != nil {
		return res, err
	}
	defer os.RemoveAll(stage) // a no-op once it has been swapped in

	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(opts.concurrency())
	var mu sync.Mutex // serialises directory creation
	for _, l := range layers {
		g.Go(func() error {
			name := l.Annotations[ocispec.AnnotationTitle]
			if err := fetchFile(gctx, repo, l, stage, name, &mu); err != nil {
				return fmt.Errorf("file %s (%s): %w", name, l.Digest, err)
			}
			log.Debug("pulled file", "file", name, "digest", l.Digest, "size", l.Size)
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return res, fmt.Errorf("pull %s: %w; %s left unchanged", ref, err, dir)
	}
	marker, err := json.MarshalIndent(Marker{Reference: ref, Digest: res.Digest, Files: res.Files, PulledAt: time.Now().UTC()}, "", "  ")
	if err != nil {
		return res, err
	}
	if err := os.WriteFile(filepath.Join(stage, MarkerFile), append(marker, '\n'), 0o644); err != nil {
		return res, err
	}
	if err := swap(stage, dir, log); err != nil {
		return res, fmt.Errorf("install into %s: %w", dir, err)
	}
	log.Info("pulled guest image", "reference", ref, "digest", res.Digest, "files", len(res.Files), "dir", dir)
	return res, nil
}

// checkManifest validates the manifest and returns its layers.
func checkManifest(desc ocispec.Descriptor, raw []byte) ([]ocispec.Descriptor, error) {
	if desc.MediaType != ocispec.MediaTypeImageManifest {
		return nil, fmt.Errorf("media type %q: not a guest image (want an OCI image manifest with artifactType %s)", desc.MediaType, ArtifactType)
	}
	var m ocispec.Manifest
	if err := json.Unmarshal(raw, &m); err != nil {
		return nil, fmt.Errorf("manifest: %w", err)
	}
	at := m.ArtifactType
	if at == "" {
		at = m.Config.MediaType // image-spec 1.0 style artifacts
	}
	if at != ArtifactType {
		return nil, fmt.Errorf("artifact type %q: not a guest image (want %s)", at, ArtifactType)
	}
	if len(m.Layers) == 0 {
		return nil, errors.New("the artifact has no files")
	}
	seen := map[string]bool{}
	for _, l := range m.Layers {
		name := l.Annotations[ocispec.AnnotationTitle]
		if l.MediaType != FileMediaType {
			return nil, fmt.Errorf("layer %s (%q): media type %q, want %s", l.Digest, name, l.MediaType, FileMediaType)
		}
		if err := checkName(name); err != nil {
			return nil, fmt.Errorf("layer %s: %w", l.Digest, err)
		}
		if err := l.Digest.Validate(); err != nil {
			return nil, fmt.Errorf("layer %q: %w", name, err)
		}
		if l.Size < 0 {
			return nil, fmt.Errorf("layer %q: size %d", name, l.Size)
		}
		if seen[name] {
			return nil, fmt.Errorf("layer name %q appears twice", name)
		}
		seen[name] = true
	}
	for name := range seen {
		for p := path.Dir(name); p != "."; p = path.Dir(p) {
			if seen[p] {
				return nil, fmt.Errorf("layer name %q is a file and the directory of %q", p, name)
			}
		}
	}
	return m.Layers, nil
}

// checkName accepts a clean, relative, slash-separated path inside the
// directory that is not the marker.
func checkName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("no %s annotation", ocispec.AnnotationTitle)
	case strings.ContainsAny(name, "\\\x00"),
		path.IsAbs(name),
		path.Clean(name) != name,
		name == "." || name == ".." || strings.HasPrefix(name, "../"),
		!filepath.IsLocal(filepath.FromSlash(name)):
		return fmt.Errorf("layer name %q escapes the image directory or is not a clean relative path", name)
	case name == MarkerFile:
		return fmt.Errorf("layer name %q is reserved", name)
	}
	return nil
}

// fetchFile downloads one layer into stage/name and verifies its digest.
func fetchFile(ctx context.Context, repo *remote.Repository, desc ocispec.Descriptor, stage, name string, mu *sync.Mutex) error {
	dst := filepath.Join(stage, filepath.FromSlash(name))
	mu.Lock()
	err := os.MkdirAll(filepath.Dir(dst), 0o755)
	mu.Unlock()
	if err != nil {
		return err
	}
	rc, err := repo.Fetch(ctx, desc)
	if err != nil {
		return err
	}
	defer rc.Close()
	f, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return err
	}
	vr := content.NewVerifyReader(rc, desc)
	_, err = io.Copy(f, vr)
	if err == nil {
		err = vr.Verify()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	switch {
	case errors.Is(err, content.ErrMismatchedDigest):
		return fmt.Errorf("content does not match its digest: refused (%w)", err)
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, content.ErrTrailingData):
		return fmt.Errorf("content is not %d bytes: refused (%w)", desc.Size, err)
	}
	return err
}
