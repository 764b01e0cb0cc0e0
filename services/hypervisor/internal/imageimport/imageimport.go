// Package imageimport turns an OCI image into a catalog image: its layers
// flattened into an erofs root behind dm-verity (ociimport), the boot chain
// of a kernel image of the catalog with the root hash on its command line,
// golden PCRs from one measuring boot of exactly that, and the policy handed
// to attestation, before the image appears in the catalog.
package imageimport

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	ocispec "github.com/opencontainers/image-spec/specs-go/v1"
	"oras.land/oras-go/v2/registry/remote/auth"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/ociboot"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/catalog"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/erofsroot"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/ociimport"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/ocirootfs"
)

// Defaults of Config.
const (
	DefaultMaxImageBytes  = 4 << 30
	DefaultStoreQuota     = 32 << 30
	DefaultMaxEntries     = 500_000
	DefaultBootImage      = "test-guest"
	DefaultMeasureTimeout = 3 * time.Minute
)

// MeasuredPCRs are what the import's measuring boot records: the firmware
// PCRs attestation compares and PCR 9, the boot chain's initrd and the
// command line that names the root.
var MeasuredPCRs = []uint{2, 3, 4, 6, 7, 9}

// Config bounds and places imports.
type Config struct {
	// MaxImageBytes bounds one image: its compressed layers, and its root's
	// file contents (--max-image-bytes).
	MaxImageBytes int64
	// StoreQuota bounds the roots of all OCI images of the catalog together
	// (--image-store-bytes).
	StoreQuota int64
	// MaxEntries bounds the entries of one image's layers together.
	MaxEntries int
	// BootImage is the kernel image that boots OCI images (--oci-boot-image).
	BootImage string
	// PlainHTTP talks HTTP to every registry; loopback ones always are.
	PlainHTTP bool
	// Credential returns a registry's credentials (nil: the Docker config,
	// as guest-image pulls).
	Credential auth.CredentialFunc
	// Firmware is the host's OVMF, recorded as golden_firmware.
	Firmware       *hypervisorv1.Firmware
	MeasureTimeout time.Duration
	MkfsErofs      string
}

// Catalog is the image directory.
type Catalog interface {
	Dir() string
	List() []*hypervisorv1.Image
	Get(ref string) (*hypervisorv1.Image, error)
	Refresh() error
}

// Measurer boots an image once and reads its PCRs (driver.Measure).
type Measurer interface {
	Measure(ctx context.Context, img *hypervisorv1.Image, dir string, pcrs []uint, timeout time.Duration) (map[uint32][]byte, error)
}

// Policies hands a policy document to attestation.
type Policies interface {
	Sync(ctx context.Context, ref string, doc []byte) error
}

// Importer runs imports, one at a time: each reads and writes a whole image
// and boots a VM once.
type Importer struct {
	cfg      Config
	cat      Catalog
	measurer Measurer
	policies Policies
	log      *slog.Logger
	one      chan struct{}

	refusedImageBytes, refusedStore atomic.Uint64
}

// New returns an importer into cat.
func New(cfg Config, cat Catalog, m Measurer, p Policies, log *slog.Logger) *Importer {
	if cfg.MaxImageBytes <= 0 {
		cfg.MaxImageBytes = DefaultMaxImageBytes
	}
	if cfg.StoreQuota <= 0 {
		cfg.StoreQuota = DefaultStoreQuota
	}
	if cfg.MaxEntries <= 0 {
		cfg.MaxEntries = DefaultMaxEntries
	}
	if cfg.BootImage == "" {
		cfg.BootImage = DefaultBootImage
	}
	if cfg.MeasureTimeout <= 0 {
		cfg.MeasureTimeout = DefaultMeasureTimeout
	}
	return &Importer{cfg: cfg, cat: cat, measurer: m, policies: p, log: log, one: make(chan struct{}, 1)}
}

// Refusals counts imports refused by a bound: --max-image-bytes, and the
// image store quota.
func (im *Importer) Refusals() (imageBytes, store uint64) {
	return im.refusedImageBytes.Load(), im.refusedStore.Load()
}

// Progress receives the import's steps; an error from it ends the import.
type Progress func(*hypervisorv1.ImportImageResponse) error

// errUnchanged ends an import whose manifest is already the catalog image's.
type errUnchanged struct{ img *hypervisorv1.Image }

func (errUnchanged) Error() string { return "unchanged" }

// Import imports req.source and returns the last message (phase DONE).
// Nothing is left behind on an error or a cancelled ctx.
func (im *Importer) Import(ctx context.Context, req *hypervisorv1.ImportImageRequest, progress func(*hypervisorv1.ImportImageResponse) error) (*hypervisorv1.ImportImageResponse, error) {
	src, err := parseSource(req.GetSource())
	if err != nil {
		return nil, err
	}
	id := req.GetId()
	if id == "" {
		id = refPart(src.name)
	}
	if err := catalog.ValidateRef(id); err != nil {
		return nil, apierr.Invalidf("id", "id %q: %s", id, apierr.MessageOf(err))
	}
	if v := req.GetVersion(); v != "" {
		if err := catalog.ValidateRef(v); err != nil || strings.Contains(v, "_") {
			return nil, apierr.Invalidf("version", "version %q: only A-Z, a-z, 0-9, '.', '+' and '-'", v)
		}
	}
	boot, err := im.bootImage(req.GetBootImage())
	if err != nil {
		return nil, err
	}
	select {
	case im.one <- struct{}{}:
		defer func() { <-im.one }()
	case <-ctx.Done():
		return nil, apierr.Errorf(apierr.Timeout, "import of %s: cancelled while another import ran", req.GetSource())
	}
	send := func(r *hypervisorv1.ImportImageResponse) error {
		if progress == nil {
			return nil
		}
		return progress(r)
	}
	if err := send(&hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_RESOLVING}); err != nil {
		return nil, err
	}
	used := im.storeBytes()
	if used >= im.cfg.StoreQuota {
		im.refusedStore.Add(1)
		return nil, apierr.Errorf(apierr.ResourceExhausted, "the image store holds %d bytes of OCI images, its quota is %d (--image-store-bytes): delete an image first", used, im.cfg.StoreQuota)
	}
	target, err := im.target(ctx, src)
	if err != nil {
		return nil, err
	}
	stage, err := os.MkdirTemp(im.cat.Dir(), StagePrefix)
	if err != nil {
		return nil, apierr.Errorf(apierr.Internal, "image directory: %v", err)
	}
	defer os.RemoveAll(stage)

	var stem string
	var progressErr error
	opts := ociimport.Options{
		Limits: ocirootfs.Limits{MaxBytes: im.cfg.MaxImageBytes, MaxEntries: im.cfg.MaxEntries},
		Erofs:  erofsroot.Options{MkfsBinary: im.cfg.MkfsErofs},
		Resolved: func(m ocispec.Descriptor, layerBytes int64) error {
			version := req.GetVersion()
			if version == "" {
				version = refPart(src.tag)
				if version == "" || isDigest(src.tag) {
					version = "sha256-" + m.Digest.Encoded()[:12]
				}
			}
			stem = id + "_" + version
			if err := catalog.ValidateRef(stem); err != nil {
				return apierr.Invalidf("version", "%s", apierr.MessageOf(err))
			}
			if old := im.exact(stem); old != nil {
				if old.GetOci().GetManifestDigest() == m.Digest.String() {
					return errUnchanged{old}
				}
				return apierr.Errorf(apierr.Conflict, "image %s exists (%s); %s is %s: import it with another version", stem, describe(old), req.GetSource(), m.Digest)
			}
			return nil
		},
		Progress: func(layer string, done, total int64) {
			if progressErr == nil {
				progressErr = send(&hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS, Layer: layer, BytesDone: done, BytesTotal: total})
			}
		},
		Built: func() {
			if progressErr == nil {
				progressErr = send(&hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_ROOT})
			}
		},
	}
	oi, err := ociimport.Import(ctx, target, src.tag, filepath.Join(stage, "oci"), opts)
	if u := (errUnchanged{}); errors.As(err, &u) {
		return &hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_DONE, Image: u.img, Unchanged: true}, nil
	}
	if err != nil {
		if apierr.CodeOf(err) == apierr.ResourceExhausted {
			im.refusedImageBytes.Add(1)
		}
		return nil, im.cancelled(ctx, err)
	}
	if progressErr != nil {
		return nil, progressErr
	}
	stored := filesSize(filepath.Join(stage, "oci", ociimport.RootFile), filepath.Join(stage, "oci", ociimport.HashFile))
	if used+stored > im.cfg.StoreQuota {
		im.refusedStore.Add(1)
		return nil, apierr.Errorf(apierr.ResourceExhausted, "image %s takes %d bytes; the image store holds %d of its quota of %d (--image-store-bytes)", stem, stored, used, im.cfg.StoreQuota)
	}
	img, doc, err := im.assemble(ctx, stage, stem, req.GetSource(), oi, boot, send)
	if err != nil {
		return nil, im.cancelled(ctx, err)
	}
	// Attestation holds the policy before any VM can boot the image.
	if err := im.policies.Sync(ctx, stem, doc); err != nil {
		return nil, im.cancelled(ctx, fmt.Errorf("handing the policy of %s to attestation: %w", stem, err))
	}
	if err := install(stage, im.cat.Dir(), stem); err != nil {
		return nil, apierr.Errorf(apierr.Internal, "installing %s: %v", stem, err)
	}
	if err := im.cat.Refresh(); err != nil {
		return nil, apierr.Errorf(apierr.Internal, "catalog: %v", err)
	}
	got, err := im.cat.Get(stem)
	if err != nil || got.GetKind() != hypervisorv1.ImageKind_IMAGE_KIND_OCI {
		return nil, apierr.Errorf(apierr.Internal, "image %s was written but the catalog does not offer it (see the hypervisor's log)", stem)
	}
	im.log.Info("OCI image imported", "image", stem, "source", req.GetSource(), "manifest", img.GetOci().GetManifestDigest(),
		"root_hash", oi.RootHash, "stored_bytes", stored)
	return &hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_DONE, Image: got}, nil
}

// bootImage is the kernel image that boots OCI images.
func (im *Importer) bootImage(ref string) (*hypervisorv1.Image, error) {
	if ref == "" {
		ref = im.cfg.BootImage
	}
	img, err := im.cat.Get(ref)
	if err != nil {
		return nil, apierr.Errorf(apierr.NotFound, "boot image %q: %s (build the test guest with make guest-image, or name a kernel image with boot_image / --oci-boot-image)", ref, apierr.MessageOf(err))
	}
	if img.GetKind() != hypervisorv1.ImageKind_IMAGE_KIND_KERNEL {
		return nil, apierr.Invalidf("boot_image", "boot image %s is not a kernel image (vmlinuz, initrd and cmdline)", img.GetRef())
	}
	return img, nil
}

// exact is the catalog image whose ref is stem, not a bare id's newest.
func (im *Importer) exact(stem string) *hypervisorv1.Image {
	for _, img := range im.cat.List() {
		if img.GetRef() == stem {
			return img
		}
	}
	return nil
}

// storeBytes are the OCI images' roots in the catalog.
func (im *Importer) storeBytes() int64 {
	var n int64
	for _, img := range im.cat.List() {
		n += img.GetOci().GetStoredBytes()
	}
	return n
}

// cancelled says an import ended by its caller as such.
func (im *Importer) cancelled(ctx context.Context, err error) error {
	if ctx.Err() != nil && apierr.CodeOf(err) != apierr.InvalidRequest {
		return apierr.Errorf(apierr.Timeout, "import cancelled: %v", ctx.Err())
	}
	return err
}

func describe(img *hypervisorv1.Image) string {
	if o := img.GetOci(); o != nil {
		return "from " + o.GetReference() + ", " + o.GetManifestDigest()
	}
	return "a " + img.GetKind().String() + " image"
}

func isDigest(s string) bool {
	_, hexPart, ok := strings.Cut(s, ":")
	return ok && len(hexPart) == 64
}

func filesSize(paths ...string) int64 {
	var n int64
	for _, p := range paths {
		if fi, err := os.Stat(p); err == nil {
			n += fi.Size()
		}
	}
	return n
}

// policyDoc is the image's policy: the measuring boot's golden PCRs, the
// firmware they were recorded on, and the OCI source with its root hash.
func (im *Importer) policyDoc(stem string, img *hypervisorv1.Image, values map[uint32][]byte) ([]byte, error) {
	id, version := img.GetId(), img.GetVersion()
	golden := map[string]string{}
	for idx, v := range values {
		golden[strconv.Itoa(int(idx))] = hex.EncodeToString(v)
	}
	o := img.GetOci()
	doc := map[string]any{
		"image_id": id, "image_version": version,
		"golden": map[string]any{"sha256": golden},
		"oci": map[string]string{
			"reference": o.GetReference(), "manifest_digest": o.GetManifestDigest(),
			"config_digest": o.GetConfigDigest(), "root_hash": o.GetRootHash(),
		},
	}
	if fw := im.cfg.Firmware; fw.GetSha256() != "" {
		m := map[string]string{"sha256": fw.GetSha256()}
		if fw.GetPackage() != "" {
			m["package"], m["version"] = fw.GetPackage(), fw.GetVersion()
		}
		doc["golden_firmware"] = m
	}
	b, err := json.MarshalIndent(doc, "", "  ")
	return append(b, '\n'), err
}

// ociRoot is the verity root an import wrote.
func ociRoot(oi *ociimport.Image) (ociboot.Root, error) {
	root, err := hex.DecodeString(oi.RootHash)
	if err != nil {
		return ociboot.Root{}, err
	}
	salt, err := hex.DecodeString(oi.Salt)
	if err != nil {
		return ociboot.Root{}, err
	}
	return ociboot.Root{RootHash: root, Salt: salt, DataBlocks: uint64(oi.RootBytes / ociboot.BlockSize)}, nil
}
