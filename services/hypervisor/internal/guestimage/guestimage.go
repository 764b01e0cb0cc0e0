// Package guestimage publishes an image directory (--image-dir) as an OCI
// artifact and installs one into an image directory (contract §8.3).
//
// The artifact is an OCI image manifest (image-spec v1.1) with artifactType
// ArtifactType, the empty config and one layer per file: media type
// FileMediaType, named by its org.opencontainers.image.title annotation (the
// slash-separated path relative to the directory). The manifest's created
// annotation is fixed to 1970-01-01T00:00:00Z, so the digest depends only on
// the files.
//
// Pull downloads into a staging directory next to the target, verifies every
// blob against its digest, and only then swaps the staging directory in, so a
// refused or failed pull leaves the image directory as it was. A pull of the
// digest the marker file (.guest-image.json) already records is a no-op; any
// other digest replaces the whole directory, including files written into it
// since the last pull (recorded golden values in <stem>.policy.json, say).
package guestimage

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"golang.org/x/sync/errgroup"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/content"
	"oras.land/oras-go/v2/registry"
	"oras.land/oras-go/v2/registry/remote"
	"oras.land/oras-go/v2/registry/remote/auth"
	"oras.land/oras-go/v2/registry/remote/credentials"
	"oras.land/oras-go/v2/registry/remote/retry"

	"github.com/giantswarm/vm-manager/pkg/buildinfo"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/catalog"
)

const (
	// ArtifactType is the manifest's artifactType.
	ArtifactType = "application/vnd.giantswarm.vm-manager.guest-image.v1"
	// FileMediaType is the media type of every layer: one file each.
	FileMediaType = "application/vnd.giantswarm.vm-manager.guest-image.file.v1"
	// MarkerFile records the pulled artifact in the image directory. It is
	// never pushed.
	MarkerFile = ".guest-image.json"
	// Created is the manifest's fixed org.opencontainers.image.created.
	Created = "1970-01-01T00:00:00Z"
	// DefaultConcurrency is how many blobs are transferred at once.
	DefaultConcurrency = 3

	maxManifestBytes = 4 << 20
)

// Options configure access to the registry.
type Options struct {
	// PlainHTTP talks HTTP instead of HTTPS (lab registries).
	PlainHTTP bool
	// Credential returns the credentials for a registry. Nil reads the Docker
	// config ($DOCKER_CONFIG/config.json, else ~/.docker/config.json, with its
	// credential helpers); a registry without an entry is accessed anonymously.
	Credential auth.CredentialFunc
	// HTTPClient is the transport; nil is oras' retrying default client.
	HTTPClient *http.Client
	// Concurrency is how many blobs are transferred at once (default 3).
	Concurrency int
	// Log receives progress; nil discards it.
	Log *slog.Logger
}

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

func (o Options) log() *slog.Logger {
	if o.Log == nil {
		return slog.New(slog.DiscardHandler)
	}
	return o.Log
}

func (o Options) concurrency() int {
	if o.Concurrency <= 0 {
		return DefaultConcurrency
	}
	return o.Concurrency
}

// DockerCredentials reads credentials from the Docker config:
// $DOCKER_CONFIG/config.json, else ~/.docker/config.json (a missing file means
// no credentials). Credential helpers (credsStore, credHelpers) are honoured.
// Without $DOCKER_CONFIG and a home directory it is anonymous.
func DockerCredentials() (auth.CredentialFunc, error) {
	if os.Getenv("DOCKER_CONFIG") == "" {
		if home, err := os.UserHomeDir(); err != nil || home == "" {
			return nil, nil
		}
	}
	store, err := credentials.NewStoreFromDocker(credentials.StoreOptions{})
	if err != nil {
		return nil, fmt.Errorf("docker config: %w", err)
	}
	return credentials.Credential(store), nil
}

func repository(ref string, opts Options) (*remote.Repository, registry.Reference, error) {
	r, err := registry.ParseReference(ref)
	if err != nil {
		return nil, r, fmt.Errorf("reference %q: %w", ref, err)
	}
	repo, err := remote.NewRepository(ref)
	if err != nil {
		return nil, r, fmt.Errorf("reference %q: %w", ref, err)
	}
	cred := opts.Credential
	if cred == nil {
		if cred, err = DockerCredentials(); err != nil {
			return nil, r, err
		}
	}
	hc := opts.HTTPClient
	if hc == nil {
		hc = retry.DefaultClient
	}
	client := &auth.Client{
		Client:     hc,
		Cache:      auth.NewCache(),
		Credential: cred,
		Header:     http.Header{"User-Agent": {"vm-manager/" + buildinfo.Version}},
	}
	repo.Client = client
	repo.PlainHTTP = opts.PlainHTTP
	repo.SkipReferrersGC = true
	return repo, r, nil
}

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

// Push publishes dir as a guest image artifact under ref, which must carry a
// tag (registry/repository:tag), and returns the manifest digest. Blobs the
// registry already has are not uploaded again. The directory must hold at
// least one catalog image; policy.json is optional.
func Push(ctx context.Context, dir, ref string, opts Options) (string, error) {
	log := opts.log()
	repo, r, err := repository(ref, opts)
	if err != nil {
		return "", err
	}
	if r.Reference == "" || r.ValidateReferenceAsTag() != nil {
		return "", fmt.Errorf("push %q: needs a tag (registry/repository:tag)", ref)
	}
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
	for i, name := range files {
		g.Go(func() error {
			desc, err := pushFile(gctx, repo, filepath.Join(dir, filepath.FromSlash(name)), name)
			if err != nil {
				return fmt.Errorf("push %s: %w", name, err)
			}
			log.Debug("pushed file", "file", name, "digest", desc.Digest, "size", desc.Size)
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
	if err := repo.Tag(ctx, desc, r.Reference); err != nil {
		return "", fmt.Errorf("tag %s: %w", r.Reference, err)
	}
	log.Info("pushed guest image", "reference", ref, "digest", desc.Digest, "files", len(files))
	return desc.Digest.String(), nil
}

// pushFile uploads one file as a layer unless the registry has its blob.
func pushFile(ctx context.Context, repo *remote.Repository, file, name string) (ocispec.Descriptor, error) {
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
	// The registry checks the digest: a file changed since it was hashed fails.
	if err := repo.Push(ctx, desc, f); err != nil {
		return ocispec.Descriptor{}, err
	}
	return desc, nil
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
	repo, r, err := repository(ref, opts)
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

// resolveDir makes dir absolute and follows a symbolic link to it, so the
// swap replaces the directory rather than the link.
func resolveDir(dir string) (string, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return "", err
	}
	real, err := filepath.EvalSymlinks(abs)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return abs, nil
	case err != nil:
		return "", err
	}
	fi, err := os.Stat(real)
	if err != nil {
		return "", err
	}
	if !fi.IsDir() {
		return "", fmt.Errorf("%s: not a directory", dir)
	}
	return real, nil
}

// swap puts stage in dir's place. Normally two renames: dir aside, stage in,
// then the old tree is removed. When dir cannot be renamed (a mount point) its
// entries are removed and stage's moved in instead (not atomic, but every file
// has been verified by then).
func swap(stage, dir string, log *slog.Logger) error {
	fi, err := os.Stat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		if err := os.Chmod(stage, 0o755); err != nil {
			return err
		}
		return os.Rename(stage, dir)
	}
	if err != nil {
		return err
	}
	if err := os.Chmod(stage, fi.Mode().Perm()); err != nil {
		return err
	}
	old := stage + ".old"
	if err := os.Rename(dir, old); err != nil {
		log.Info("cannot move the image directory aside; replacing its contents", "dir", dir, "err", err)
		return replaceContents(stage, dir)
	}
	if err := os.Rename(stage, dir); err != nil {
		if rerr := os.Rename(old, dir); rerr != nil {
			return fmt.Errorf("%w (and restoring the old directory from %s: %v)", err, old, rerr)
		}
		return err
	}
	if err := os.RemoveAll(old); err != nil {
		log.Warn("removing the previous image directory", "dir", old, "err", err)
	}
	return nil
}

func replaceContents(stage, dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range entries {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	staged, err := os.ReadDir(stage)
	if err != nil {
		return err
	}
	// The marker goes last: a directory without it is pulled again.
	slices.SortStableFunc(staged, func(a, b os.DirEntry) int {
		return boolCmp(a.Name() == MarkerFile, b.Name() == MarkerFile)
	})
	for _, e := range staged {
		if err := move(filepath.Join(stage, e.Name()), filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

func boolCmp(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

// move renames src to dst, copying across file systems.
func move(src, dst string) error {
	err := os.Rename(src, dst)
	if !errors.Is(err, syscall.EXDEV) {
		return err
	}
	fi, err := os.Stat(src)
	if err != nil {
		return err
	}
	if fi.IsDir() {
		err = os.CopyFS(dst, os.DirFS(src))
	} else {
		err = copyFile(src, dst, fi.Mode().Perm())
	}
	if err != nil {
		return err
	}
	return os.RemoveAll(src)
}

func copyFile(src, dst string, perm fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
