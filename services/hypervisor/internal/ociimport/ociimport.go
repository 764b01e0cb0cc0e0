// Package ociimport turns an OCI image into a verity-protected root for a
// VM: the image's manifest and config are read from a registry repository
// or an OCI layout (both oras targets), its layers flattened (ocirootfs),
// written as erofs (erofsroot) and given a dm-verity hash device (verity),
// whose root hash, once on a measured command line, names the image's
// content in every quote. What it writes is a directory: root.erofs,
// root.verity and image.json (the source and the config the VM runs).
// A refused image leaves nothing behind.
package ociimport

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/content"

	"github.com/giantswarm/vm-manager/pkg/ociboot"
	"github.com/giantswarm/vm-manager/pkg/verity"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/erofsroot"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/ocirootfs"
)

// Files of an imported image's directory.
const (
	RootFile   = "root.erofs"
	HashFile   = "root.verity"
	ConfigFile = "image.json"
)

// Image is what an import recorded (image.json).
type Image struct {
	// The source: the reference as given, the manifest's and the config's
	// digests.
	Reference      string `json:"reference"`
	ManifestDigest string `json:"manifestDigest"`
	ConfigDigest   string `json:"configDigest"`
	// RootHash and Salt are the verity root's (hex): roothash= on the
	// command line.
	RootHash string `json:"rootHash"`
	Salt     string `json:"salt"`
	// RootBytes is root.erofs's size; Entries and FileBytes the root's.
	RootBytes int64 `json:"rootBytes"`
	Entries   int   `json:"entries"`
	FileBytes int64 `json:"fileBytes"`
	// Config is what the VM runs: entrypoint, cmd, env, working directory, user.
	Config ocispec.ImageConfig `json:"config"`
}

// Options bound and place an import.
type Options struct {
	Limits ocirootfs.Limits
	Erofs  erofsroot.Options
	// Resolved, when set, sees the manifest before any layer is read (an
	// import may refuse it there: an existing version of another digest).
	Resolved func(manifest ocispec.Descriptor, layerBytes int64) error
	// Progress, when set, is told the compressed layer bytes read so far.
	Progress func(layer string, done, total int64)
	// Built, when set, is told the layers are flattened and the root is
	// being written.
	Built func()
}

// maxMetadata bounds a manifest or config read into memory.
const maxMetadata = 4 << 20

// Import reads ref's image from src into dir (created; removed again on an
// error).
func Import(ctx context.Context, src oras.ReadOnlyTarget, ref, dir string, o Options) (img *Image, err error) {
	desc, err := src.Resolve(ctx, ref)
	if err != nil {
		return nil, apierr.Errorf(apierr.NotFound, "image %q: %v", ref, err)
	}
	manifest, mdesc, err := readManifest(ctx, src, desc)
	if err != nil {
		return nil, err
	}
	cfgBytes, err := fetch(ctx, src, manifest.Config, "config")
	if err != nil {
		return nil, err
	}
	var cfg ocispec.Image
	if err := json.Unmarshal(cfgBytes, &cfg); err != nil {
		return nil, apierr.Invalidf("image", "image %q: config %s: %v", ref, manifest.Config.Digest, err)
	}
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			os.RemoveAll(dir)
		}
	}()
	var compressed int64
	for _, l := range manifest.Layers {
		compressed += l.Size
	}
	if max := o.Limits.MaxBytes; max > 0 && compressed > max {
		return nil, apierr.Errorf(apierr.ResourceExhausted, "image %q: its layers take %d bytes, over %d (--max-image-bytes)", ref, compressed, max)
	}
	if o.Resolved != nil {
		if err := o.Resolved(mdesc, compressed); err != nil {
			return nil, err
		}
	}
	layers := make([]ocirootfs.Layer, len(manifest.Layers))
	var read int64
	for i, l := range manifest.Layers {
		layers[i] = ocirootfs.Layer{Digest: l.Digest.String(), MediaType: l.MediaType,
			Open: func() (io.ReadCloser, error) {
				rc, err := src.Fetch(ctx, l)
				if err != nil || o.Progress == nil {
					return rc, err
				}
				return &counting{ReadCloser: rc, report: func(n int64) {
					read += n
					o.Progress(l.Digest.String(), read, compressed)
				}}, nil
			}}
	}
	tarPath := filepath.Join(dir, "root.tar")
	tf, err := os.Create(tarPath)
	if err != nil {
		return nil, err
	}
	stats, err := ocirootfs.Flatten(ctx, layers, o.Limits, tf)
	if cerr := tf.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	if o.Built != nil {
		o.Built()
	}
	// The root is a bundle: the file system under rootfs/, and what to run
	// beside it, so the root hash covers the config too.
	boot, err := json.MarshalIndent(ociboot.Config{ManifestDigest: mdesc.Digest.String(), ConfigDigest: manifest.Config.Digest.String(),
		Entrypoint: cfg.Config.Entrypoint, Cmd: cfg.Config.Cmd, Env: cfg.Config.Env, WorkingDir: cfg.Config.WorkingDir, User: cfg.Config.User}, "", "  ")
	if err != nil {
		return nil, err
	}
	eo := o.Erofs
	eo.Subdir, eo.Files = ociboot.RootfsDir, map[string][]byte{ociboot.ConfigFile: append(boot, '\n')}
	if err := buildRoot(ctx, tarPath, filepath.Join(dir, RootFile), eo); err != nil {
		return nil, err
	}
	salt := sha256.Sum256([]byte("vm-manager verity salt " + mdesc.Digest.String()))
	root, size, err := hashRoot(filepath.Join(dir, RootFile), filepath.Join(dir, HashFile), salt[:])
	if err != nil {
		return nil, err
	}
	img = &Image{Reference: ref, ManifestDigest: mdesc.Digest.String(), ConfigDigest: manifest.Config.Digest.String(),
		RootHash: hex.EncodeToString(root), Salt: hex.EncodeToString(salt[:]), RootBytes: size,
		Entries: stats.Entries, FileBytes: stats.Bytes, Config: cfg.Config}
	b, err := json.MarshalIndent(img, "", "  ")
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, ConfigFile), append(b, '\n'), 0o600); err != nil {
		return nil, err
	}
	return img, nil
}

// readManifest reads the image manifest desc names, through an index to
// its linux/amd64 entry.
func readManifest(ctx context.Context, src oras.ReadOnlyTarget, desc ocispec.Descriptor) (*ocispec.Manifest, ocispec.Descriptor, error) {
	b, err := fetch(ctx, src, desc, "manifest")
	if err != nil {
		return nil, desc, err
	}
	switch desc.MediaType {
	case ocispec.MediaTypeImageIndex, "application/vnd.docker.distribution.manifest.list.v2+json":
		var idx ocispec.Index
		if err := json.Unmarshal(b, &idx); err != nil {
			return nil, desc, apierr.Invalidf("image", "index %s: %v", desc.Digest, err)
		}
		for _, m := range idx.Manifests {
			if p := m.Platform; p != nil && p.OS == "linux" && p.Architecture == "amd64" {
				return readManifest(ctx, src, m)
			}
		}
		return nil, desc, apierr.Invalidf("image", "index %s has no linux/amd64 image", desc.Digest)
	case ocispec.MediaTypeImageManifest, "application/vnd.docker.distribution.manifest.v2+json":
		var m ocispec.Manifest
		if err := json.Unmarshal(b, &m); err != nil {
			return nil, desc, apierr.Invalidf("image", "manifest %s: %v", desc.Digest, err)
		}
		return &m, desc, nil
	default:
		return nil, desc, apierr.Invalidf("image", "%s is a %q, not an image manifest or index", desc.Digest, desc.MediaType)
	}
}

// fetch reads a small blob whole, checking its size and digest.
func fetch(ctx context.Context, src oras.ReadOnlyTarget, desc ocispec.Descriptor, what string) ([]byte, error) {
	if desc.Size > maxMetadata {
		return nil, apierr.Invalidf("image", "%s %s is %d bytes, over %d", what, desc.Digest, desc.Size, maxMetadata)
	}
	b, err := content.FetchAll(ctx, src, desc)
	if err != nil {
		return nil, apierr.Invalidf("image", "%s %s: %v", what, desc.Digest, err)
	}
	return b, nil
}

// buildRoot writes the erofs image of the flattened tar, then drops the tar.
func buildRoot(ctx context.Context, tarPath, out string, o erofsroot.Options) error {
	f, err := os.Open(tarPath)
	if err != nil {
		return err
	}
	defer os.Remove(tarPath)
	defer f.Close()
	return erofsroot.Build(ctx, f, out, o)
}

// hashRoot writes root's verity hash device and returns its root hash and
// root's size.
func hashRoot(root, hash string, salt []byte) ([]byte, int64, error) {
	f, err := os.Open(root)
	if err != nil {
		return nil, 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, 0, err
	}
	if fi.Size()%verity.BlockSize != 0 {
		return nil, 0, fmt.Errorf("%s: %d bytes, not whole %d-byte blocks", root, fi.Size(), verity.BlockSize)
	}
	h, err := os.Create(hash)
	if err != nil {
		return nil, 0, err
	}
	sum, err := verity.Format(f, fi.Size(), h, verity.Params{Salt: salt})
	if cerr := h.Close(); err == nil {
		err = cerr
	}
	return sum, fi.Size(), err
}

// counting reports the bytes read through it, at most every 1 MiB.
type counting struct {
	io.ReadCloser
	report  func(int64)
	pending int64
}

func (c *counting) Read(p []byte) (int, error) {
	n, err := c.ReadCloser.Read(p)
	c.pending += int64(n)
	if c.pending >= 1<<20 || err != nil && c.pending > 0 {
		c.report(c.pending)
		c.pending = 0
	}
	return n, err
}
