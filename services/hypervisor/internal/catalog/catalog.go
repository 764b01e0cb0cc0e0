// Package catalog reads the image directory (--image-dir): UKI images
// (<id>_<version>.efi + .raw), direct-kernel images (<id>_<version>.vmlinuz
// + .initrd, optional .cmdline) and imported OCI images (a kernel image's
// files plus .erofs, .verity and .oci.json: oci.go), their policy.json and
// the Kubernetes versions of the sysupdate tree.
package catalog

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// DefaultCmdline is the command line of a kernel image without a .cmdline file.
const DefaultCmdline = "console=ttyS0 panic=-1"

// File suffixes of the catalog.
const (
	extUKI     = ".efi"
	extDisk    = ".raw"
	extKernel  = ".vmlinuz"
	extInitrd  = ".initrd"
	extCmdline = ".cmdline"
	extPolicy  = ".policy.json"

	sharedPolicy = "policy.json"
	sysupdateDir = "sysupdate"
	extSysupdate = ".sysupdate"
)

// Catalog is the set of images in one directory. It is safe for concurrent
// use; Refresh swaps in a new snapshot while readers keep the old one.
type Catalog struct {
	dir string
	log *slog.Logger

	mu   sync.RWMutex
	snap *snapshot
}

type snapshot struct {
	images   []*hypervisorv1.Image // sorted: id ascending, newest version first
	byRef    map[string]*hypervisorv1.Image
	newest   map[string]*hypervisorv1.Image // by id
	policies map[string][]byte              // by ref, only valid documents
}

// Load reads dir. A missing directory is an empty catalog, so images can be
// added later and picked up by Refresh.
func Load(dir string, log *slog.Logger) (*Catalog, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("image directory %q: %w", dir, err)
	}
	c := &Catalog{dir: abs, log: log}
	snap, err := c.load()
	if err != nil {
		return nil, err
	}
	c.snap = snap
	return c, nil
}

// Dir is the absolute image directory.
func (c *Catalog) Dir() string { return c.dir }

// Refresh reloads the directory. On error the previous catalog stays.
func (c *Catalog) Refresh() error {
	snap, err := c.load()
	if err != nil {
		return err
	}
	c.mu.Lock()
	c.snap = snap
	c.mu.Unlock()
	return nil
}

func (c *Catalog) current() *snapshot {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.snap
}

// List returns every image, sorted by id ascending, then newest version first.
func (c *Catalog) List() []*hypervisorv1.Image {
	snap := c.current()
	out := make([]*hypervisorv1.Image, len(snap.images))
	for i, img := range snap.images {
		out[i] = proto.CloneOf(img)
	}
	return out
}

// Get resolves ref: "<id>_<version>", or a bare id for its newest version.
func (c *Catalog) Get(ref string) (*hypervisorv1.Image, error) {
	if err := ValidateRef(ref); err != nil {
		return nil, err
	}
	img := c.current().resolve(ref)
	if img == nil {
		return nil, apierr.Errorf(apierr.NotFound, "image %q not found", ref)
	}
	return proto.CloneOf(img), nil
}

// Default is the image with the highest version; on a tie, the first id.
func (c *Catalog) Default() (*hypervisorv1.Image, error) {
	var best *hypervisorv1.Image
	// images is sorted by id, so a strict comparison keeps the first id on a tie.
	for _, img := range c.current().images {
		if best == nil || CompareVersions(img.GetVersion(), best.GetVersion()) > 0 {
			best = img
		}
	}
	if best == nil {
		return nil, apierr.Errorf(apierr.NotFound, "no image in %s", c.dir)
	}
	return proto.CloneOf(best), nil
}

// PolicyDocument returns the raw policy.json that applies to ref (resolved
// like Get), or false when there is none or it is not valid JSON.
func (c *Catalog) PolicyDocument(ref string) ([]byte, bool) {
	if ValidateRef(ref) != nil {
		return nil, false
	}
	snap := c.current()
	img := snap.resolve(ref)
	if img == nil {
		return nil, false
	}
	doc, ok := snap.policies[img.GetRef()]
	return bytes.Clone(doc), ok
}

func (s *snapshot) resolve(ref string) *hypervisorv1.Image {
	// An id may itself contain '_', so an exact ref is tried before a bare id.
	if img, ok := s.byRef[ref]; ok {
		return img
	}
	return s.newest[ref]
}

// ValidateRef rejects what cannot name an image: empty, path-like, or a
// character outside [A-Za-z0-9._+-].
func ValidateRef(ref string) error {
	if ref == "" {
		return apierr.Errorf(apierr.InvalidRequest, "image reference is empty")
	}
	if strings.Contains(ref, "/") || strings.Contains(ref, "..") {
		return apierr.Errorf(apierr.InvalidRequest, "invalid image reference %q: must not contain '/' or '..'", ref)
	}
	for _, r := range ref {
		if !isRefChar(r) {
			return apierr.Errorf(apierr.InvalidRequest, "invalid image reference %q: only A-Z, a-z, 0-9, '.', '_', '+' and '-' are allowed", ref)
		}
	}
	return nil
}

func isRefChar(r rune) bool {
	return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' ||
		r == '.' || r == '_' || r == '+' || r == '-'
}

// stemFiles is what the directory holds for one <id>_<version> stem.
type stemFiles struct {
	efi, raw, vmlinuz, initrd, cmdline, policy bool
	oci, erofs, verity                         bool
}

func (c *Catalog) load() (*snapshot, error) {
	snap := &snapshot{
		byRef:    map[string]*hypervisorv1.Image{},
		newest:   map[string]*hypervisorv1.Image{},
		policies: map[string][]byte{},
	}
	entries, err := os.ReadDir(c.dir)
	if errors.Is(err, fs.ErrNotExist) {
		c.log.Info("image directory does not exist; the catalog is empty", "dir", c.dir)
		return snap, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading image directory: %w", err)
	}

	stems := map[string]*stemFiles{}
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		name := e.Name()
		if name == sharedPolicy {
			continue
		}
		for _, s := range []struct {
			ext  string
			flag func(*stemFiles) *bool
		}{
			// .policy.json before any shorter suffix it could be confused with.
			{extPolicy, func(f *stemFiles) *bool { return &f.policy }},
			{extOCI, func(f *stemFiles) *bool { return &f.oci }},
			{extErofs, func(f *stemFiles) *bool { return &f.erofs }},
			{extVerity, func(f *stemFiles) *bool { return &f.verity }},
			{extUKI, func(f *stemFiles) *bool { return &f.efi }},
			{extDisk, func(f *stemFiles) *bool { return &f.raw }},
			{extKernel, func(f *stemFiles) *bool { return &f.vmlinuz }},
			{extInitrd, func(f *stemFiles) *bool { return &f.initrd }},
			{extCmdline, func(f *stemFiles) *bool { return &f.cmdline }},
		} {
			stem, ok := strings.CutSuffix(name, s.ext)
			if !ok {
				continue
			}
			if stems[stem] == nil {
				stems[stem] = &stemFiles{}
			}
			*s.flag(stems[stem]) = true
			break
		}
	}

	kube := map[string][]string{} // by sysupdate tree
	shared := c.sharedPolicy()

	for _, stem := range slices.Sorted(maps.Keys(stems)) {
		img := c.image(stem, stems[stem])
		if img == nil {
			continue
		}
		if dir := SysupdateDir(c.dir, stem); isDir(dir) {
			img.SysupdateDir = dir
			if _, ok := kube[dir]; !ok {
				kube[dir] = c.kubernetesVersions(dir)
			}
			img.KubernetesVersions = slices.Clone(kube[dir])
		}
		if doc, policy := c.policy(img, stems[stem].policy, shared); policy != nil {
			img.Policy = policy
			snap.policies[img.Ref] = doc
		}
		snap.images = append(snap.images, img)
	}

	slices.SortFunc(snap.images, func(a, b *hypervisorv1.Image) int {
		if c := strings.Compare(a.Id, b.Id); c != 0 {
			return c
		}
		return CompareVersions(b.Version, a.Version)
	})
	for _, img := range snap.images {
		snap.byRef[img.Ref] = img
		if snap.newest[img.Id] == nil {
			snap.newest[img.Id] = img
		}
	}
	return snap, nil
}

// image builds the image of one stem, or nil (with a warning) when the stem
// is not a complete image.
func (c *Catalog) image(stem string, f *stemFiles) (img *hypervisorv1.Image) {
	path := func(ext string) string { return filepath.Join(c.dir, stem+ext) }
	uki := f.efi && f.raw
	kernel := f.vmlinuz && f.initrd
	if !uki && !kernel {
		for _, lone := range []struct {
			has       bool
			ext, want string
		}{
			{f.efi, extUKI, extDisk},
			{f.raw, extDisk, extUKI},
			{f.vmlinuz, extKernel, extInitrd},
			{f.initrd, extInitrd, extKernel},
		} {
			if lone.has {
				c.log.Warn("image file skipped: no matching "+lone.want, "file", path(lone.ext))
			}
		}
		if f.cmdline && !f.vmlinuz && !f.initrd {
			c.log.Warn("image file skipped: no matching "+extKernel+" and "+extInitrd, "file", path(extCmdline))
		}
		if f.policy && !f.efi && !f.raw && !f.vmlinuz && !f.initrd {
			c.log.Warn("policy skipped: no image with this stem", "file", path(extPolicy))
		}
		return nil
	}

	i := strings.LastIndex(stem, "_")
	if i <= 0 || i == len(stem)-1 {
		c.log.Warn("image skipped: the file stem is not <id>_<version>", "stem", stem, "dir", c.dir)
		return nil
	}
	if err := ValidateRef(stem); err != nil {
		c.log.Warn("image skipped: its name cannot be referenced", "stem", stem, "error", err)
		return nil
	}
	img = &hypervisorv1.Image{Id: stem[:i], Version: stem[i+1:], Ref: stem}
	if uki {
		if kernel {
			c.log.Warn("image has both UKI and kernel files; the UKI is used", "ref", stem)
		}
		img.Kind = hypervisorv1.ImageKind_IMAGE_KIND_UKI
		img.Uki, img.Disk = path(extUKI), path(extDisk)
		return img
	}
	img.Kind = hypervisorv1.ImageKind_IMAGE_KIND_KERNEL
	img.Kernel, img.Initrd = path(extKernel), path(extInitrd)
	img.Cmdline = DefaultCmdline
	defer func() {
		// An OCI image is a kernel image with a root: never offered as a
		// plain kernel image, which would boot without it.
		if img != nil && (f.oci || f.erofs || f.verity) {
			if err := c.oci(img, f); err != nil {
				c.log.Warn("OCI image skipped", "ref", stem, "error", err)
				img = nil
			}
		}
	}()
	if f.cmdline {
		b, err := os.ReadFile(path(extCmdline))
		if err != nil {
			// Booting with a command line the operator did not write is worse than not offering the image.
			c.log.Warn("image skipped: unreadable command line", "ref", stem, "error", err)
			return nil
		}
		// Newlines in the file are separators, not part of the command line.
		if cmdline := strings.Join(strings.Fields(string(b)), " "); cmdline != "" {
			img.Cmdline = cmdline
		}
	}
	return img
}

// SysupdateDir is the sysupdate tree an image's guests fetch from: the
// image's own <stem>.sysupdate/ when it has one (a real OS and a test guest
// bring different extensions), else the directory-wide sysupdate/.
func SysupdateDir(imageDir, stem string) string {
	if own := filepath.Join(imageDir, stem+extSysupdate); isDir(own) {
		return own
	}
	return filepath.Join(imageDir, sysupdateDir)
}

func isDir(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.IsDir()
}

// kubernetesVersions reads <tree>/kubernetes/SHA256SUMS, newest first.
func (c *Catalog) kubernetesVersions(tree string) []string {
	path := filepath.Join(tree, "kubernetes", "SHA256SUMS")
	b, err := os.ReadFile(path)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			c.log.Warn("kubernetes versions unreadable", "file", path, "error", err)
		}
		return nil
	}
	var versions []string
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) != 2 {
			continue
		}
		// sha256sum marks binary mode with a leading '*'.
		name := strings.TrimPrefix(fields[1], "*")
		v, ok := strings.CutPrefix(name, "kubernetes_")
		if !ok {
			continue
		}
		v, ok = strings.CutSuffix(v, ".raw")
		if !ok || v == "" || slices.Contains(versions, v) {
			continue
		}
		versions = append(versions, v)
	}
	slices.SortFunc(versions, func(a, b string) int { return CompareVersions(b, a) })
	return versions
}

// policyDoc is a parsed policy file.
type policyDoc struct {
	raw    []byte
	parsed *structpb.Struct
}

// sharedPolicy reads the directory-wide policy.json, or nil.
func (c *Catalog) sharedPolicy() *policyDoc {
	doc, err := c.readPolicy(filepath.Join(c.dir, sharedPolicy))
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			c.log.Warn("shared policy ignored", "error", err)
		}
		return nil
	}
	return doc
}

// policy returns the policy of img: its own <ref>.policy.json if there is
// one, else the shared one when its image_id / image_version are absent or
// match. An invalid own policy does not fall back to the shared one: that
// would silently verify against a document the operator meant to replace.
func (c *Catalog) policy(img *hypervisorv1.Image, own bool, shared *policyDoc) ([]byte, *structpb.Struct) {
	if own {
		doc, err := c.readPolicy(filepath.Join(c.dir, img.Ref+extPolicy))
		if err != nil {
			c.log.Warn("image policy ignored", "ref", img.Ref, "error", err)
			return nil, nil
		}
		return doc.raw, doc.parsed
	}
	if shared == nil {
		return nil, nil
	}
	for key, want := range map[string]string{"image_id": img.Id, "image_version": img.Version} {
		v, ok := shared.parsed.GetFields()[key]
		if !ok {
			continue
		}
		if s, isString := v.GetKind().(*structpb.Value_StringValue); !isString || s.StringValue != want {
			return nil, nil
		}
	}
	return shared.raw, shared.parsed
}

func (c *Catalog) readPolicy(path string) (*policyDoc, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	s := &structpb.Struct{}
	if err := protojson.Unmarshal(b, s); err != nil {
		return nil, fmt.Errorf("%s: not a JSON object: %w", path, err)
	}
	return &policyDoc{raw: b, parsed: s}, nil
}
