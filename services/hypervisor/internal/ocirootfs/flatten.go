// Package ocirootfs flattens an OCI image's layers into one root filesystem,
// as the image spec's changeset rules say (whiteouts, opaque directories,
// hard links, modes, owners and xattrs kept), written as one tar stream that
// a filesystem builder (erofs) takes. The layers come from whoever pulled
// them; nothing here touches the host's filesystem: the tree is built by
// name, so a hostile layer cannot make the host write outside of it, and
// what could not be built inside a VM's root (a path that climbs out, a
// device node, a symlink that points above the root, an entry under a
// symlink) is refused with invalid_request naming the layer and the entry.
package ocirootfs

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"path"
	"strings"

	"github.com/klauspost/compress/zstd"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// Layer is one layer blob, in order from the base.
type Layer struct {
	// Digest is the blob's "sha256:<hex>", checked against its bytes.
	Digest string
	// MediaType is an OCI (or Docker) tar, tar+gzip or tar+zstd layer type.
	MediaType string
	// Open reads the blob from its start; Flatten reads each layer twice.
	Open func() (io.ReadCloser, error)
}

// Limits bound what an image can make Flatten hold and write.
type Limits struct {
	// MaxBytes bounds the root's file contents, summed over the final tree.
	MaxBytes int64
	// MaxEntries bounds the entries of all layers together.
	MaxEntries int
}

// Stats say what the root holds.
type Stats struct {
	Entries int   // in the flattened root
	Bytes   int64 // of file contents
}

// A zstd layer's decoder bounds: zstd's own default window limit, and the
// memory one frame may make the decoder hold.
const (
	maxZstdWindow = 8 << 20
	maxZstdMemory = 256 << 20
)

// Whiteout names (image spec, "Representing Changes").
const (
	whiteoutPrefix = ".wh."
	opaqueWhiteout = ".wh..wh..opq"
)

// node is the final state of one path: the layer entry that provides it.
type node struct {
	layer, entry int
	hdr          *tar.Header
	// linkTo is, for a hard link, the entry its target was when the link
	// was made: a later layer replacing the target breaks the link.
	linkTo *node
}

// tree is the root being built, by cleaned absolute path.
type tree struct {
	nodes   map[string]*node
	entries int
	bytes   int64
	lim     Limits
}

// Flatten writes the root the layers make to w as one tar stream, each path
// once, in layer order. Every layer is read twice (the tree, then the
// contents); a digest that does not match either time is refused. Every
// refusal of an entry comes before anything is written; a blob that changes
// between the two reads can leave part of a stream, so w is a temporary file
// the caller removes on an error.
func Flatten(ctx context.Context, layers []Layer, lim Limits, w io.Writer) (Stats, error) {
	t := &tree{nodes: map[string]*node{}, lim: lim}
	for i, l := range layers {
		if err := eachEntry(ctx, i, l, func(j int, hdr *tar.Header, _ io.Reader) error { return t.apply(i, j, l, hdr) }); err != nil {
			return Stats{}, err
		}
	}
	tw := tar.NewWriter(w)
	for i, l := range layers {
		err := eachEntry(ctx, i, l, func(j int, hdr *tar.Header, body io.Reader) error {
			name, _ := entryPath(hdr.Name)
			n := t.nodes[name]
			if n == nil || n.layer != i || n.entry != j {
				return nil // replaced or deleted by a later layer, or a whiteout
			}
			if n.linkTo != nil {
				target := t.nodes[cleanLink(n.hdr.Linkname)]
				if target != n.linkTo {
					return refuse(i, l, hdr.Name, "a hard link to %s, which a later layer replaced", n.hdr.Linkname)
				}
			}
			out := *n.hdr
			out.Format = tar.FormatPAX // long names, xattrs (SCHILY.xattr.*)
			out.Name = strings.TrimPrefix(name, "/")
			if out.Typeflag == tar.TypeDir {
				out.Name += "/"
			}
			if out.Typeflag == tar.TypeLink {
				out.Linkname = strings.TrimPrefix(cleanLink(out.Linkname), "/")
			}
			if err := tw.WriteHeader(&out); err != nil {
				return err
			}
			if out.Typeflag == tar.TypeReg {
				if _, err := io.Copy(tw, body); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return Stats{}, err
		}
	}
	if err := tw.Close(); err != nil {
		return Stats{}, err
	}
	return Stats{Entries: len(t.nodes), Bytes: t.bytes}, nil
}

// eachEntry reads layer i's tar entries, checking its digest at the end.
func eachEntry(ctx context.Context, i int, l Layer, fn func(j int, hdr *tar.Header, body io.Reader) error) error {
	want, ok := strings.CutPrefix(l.Digest, "sha256:")
	if !ok || len(want) != 64 {
		return apierr.Invalidf("layers", "layer %d: digest %.80q is not sha256:<64 hex>", i, l.Digest)
	}
	rc, err := l.Open()
	if err != nil {
		return fmt.Errorf("layer %d (%s): %w", i, l.Digest, err)
	}
	defer rc.Close()
	sum := sha256.New()
	blob := io.TeeReader(rc, sum)
	var r io.Reader
	switch l.MediaType {
	case ocispec.MediaTypeImageLayer, "application/vnd.docker.image.rootfs.diff.tar":
		r = blob
	case ocispec.MediaTypeImageLayerGzip, "application/vnd.docker.image.rootfs.diff.tar.gzip":
		zr, err := gzip.NewReader(blob)
		if err != nil {
			return refuse(i, l, "", "not gzip: %v", err)
		}
		defer zr.Close()
		r = zr
	case ocispec.MediaTypeImageLayerZstd:
		// Bounded: a hostile frame may ask for a huge window.
		zr, err := zstd.NewReader(blob, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(maxZstdWindow), zstd.WithDecoderMaxMemory(maxZstdMemory))
		if err != nil {
			return refuse(i, l, "", "not zstd: %v", err)
		}
		defer zr.Close()
		r = zr
	default:
		return refuse(i, l, "", "media type %q is not a tar, tar+gzip or tar+zstd layer", l.MediaType)
	}
	tr := tar.NewReader(r)
	for j := 0; ; j++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return refuse(i, l, "", "not a tar stream: %v", err)
		}
		if err := fn(j, hdr, tr); err != nil {
			return err
		}
	}
	// What follows the tar's end is part of the blob too.
	if _, err := io.Copy(io.Discard, blob); err != nil {
		return fmt.Errorf("layer %d (%s): %w", i, l.Digest, err)
	}
	if got := hex.EncodeToString(sum.Sum(nil)); got != want {
		return refuse(i, l, "", "its content's digest is sha256:%s", got)
	}
	return nil
}

// apply adds entry j of layer i to the tree.
func (t *tree) apply(i, j int, l Layer, hdr *tar.Header) error {
	where := func(format string, args ...any) error { return refuse(i, l, hdr.Name, format, args...) }
	if t.entries++; t.lim.MaxEntries > 0 && t.entries > t.lim.MaxEntries {
		return apierr.Errorf(apierr.ResourceExhausted, "the image has more than %d entries", t.lim.MaxEntries)
	}
	name, ok := entryPath(hdr.Name)
	if !ok {
		return where("the path climbs out of the root")
	}
	if name == "/" {
		return nil // the root's own entry: the root is the VM's
	}
	dir, base := path.Split(name)
	dir = path.Clean(dir)
	if err := t.underSymlink(dir); err != nil {
		return where("%v", err)
	}
	switch {
	case base == opaqueWhiteout:
		t.removeUnder(dir, i)
		return nil
	case strings.HasPrefix(base, whiteoutPrefix):
		t.remove(path.Join(dir, base[len(whiteoutPrefix):]))
		return nil
	}
	n := &node{layer: i, entry: j, hdr: hdr}
	switch hdr.Typeflag {
	case tar.TypeReg, tar.TypeDir, tar.TypeFifo:
	case tar.TypeSymlink:
		if escapes(dir, hdr.Linkname) {
			return where("a symlink to %.200q points above the root", hdr.Linkname)
		}
	case tar.TypeLink:
		target := t.nodes[cleanLink(hdr.Linkname)]
		if target == nil || target.hdr.Typeflag != tar.TypeReg {
			return where("a hard link to %.200q, which is no file of the image", hdr.Linkname)
		}
		n.linkTo = target
	case tar.TypeChar, tar.TypeBlock:
		return where("a device node")
	default:
		return where("tar entry type %q is not a file, directory, link or fifo", hdr.Typeflag)
	}
	old := t.nodes[name]
	if old != nil && !(old.hdr.Typeflag == tar.TypeDir && hdr.Typeflag == tar.TypeDir) {
		t.remove(name) // a directory replaced by a file takes its contents along
	}
	if hdr.Typeflag == tar.TypeReg {
		if t.bytes += hdr.Size; t.lim.MaxBytes > 0 && t.bytes > t.lim.MaxBytes {
			return apierr.Errorf(apierr.ResourceExhausted, "the image's files exceed %d bytes (--max-image-bytes)", t.lim.MaxBytes)
		}
	}
	t.nodes[name] = n
	return nil
}

// underSymlink refuses a path whose parent directories include a symlink:
// what it names is wherever the link points.
func (t *tree) underSymlink(dir string) error {
	for d := dir; d != "/"; d = path.Dir(d) {
		if n := t.nodes[d]; n != nil && n.hdr.Typeflag == tar.TypeSymlink {
			return fmt.Errorf("it is under %s, a symlink", d)
		}
	}
	return nil
}

// remove deletes a path and what is under it.
func (t *tree) remove(name string) {
	t.removeUnder(name, -1)
	if n := t.nodes[name]; n != nil {
		t.forget(n)
		delete(t.nodes, name)
	}
}

// removeUnder deletes what is under dir from layers before layer (all of it
// when layer is -1): an opaque directory hides its lower layers' contents.
func (t *tree) removeUnder(dir string, layer int) {
	prefix := strings.TrimSuffix(dir, "/") + "/"
	for p, n := range t.nodes {
		if strings.HasPrefix(p, prefix) && (layer < 0 || n.layer < layer) {
			t.forget(n)
			delete(t.nodes, p)
		}
	}
}

func (t *tree) forget(n *node) {
	if n.hdr.Typeflag == tar.TypeReg {
		t.bytes -= n.hdr.Size
	}
}

// entryPath is a tar name as a clean absolute path; ok is false when a ".."
// would climb above the root.
func entryPath(name string) (string, bool) {
	depth := 0
	for _, c := range strings.Split(name, "/") {
		switch c {
		case "", ".":
		case "..":
			if depth--; depth < 0 {
				return "", false
			}
		default:
			depth++
		}
	}
	return path.Clean("/" + name), true
}

// cleanLink is a hard link's target as a tree path (targets are root-relative).
func cleanLink(target string) string { return path.Clean("/" + target) }

// escapes says whether a relative symlink in dir climbs above the root.
// An absolute target is resolved in the VM's root, never the host's.
func escapes(dir, target string) bool {
	if strings.HasPrefix(target, "/") {
		return false
	}
	depth := 0
	for _, c := range strings.Split(dir, "/") {
		if c != "" {
			depth++
		}
	}
	for _, c := range strings.Split(target, "/") {
		switch c {
		case "", ".":
		case "..":
			if depth--; depth < 0 {
				return true
			}
		default:
			depth++
		}
	}
	return false
}

// refuse is a broken or hostile layer, named.
func refuse(i int, l Layer, entry, format string, args ...any) error {
	what := fmt.Sprintf(format, args...)
	if entry != "" {
		return apierr.Invalidf("layers", "layer %d (%s): entry %.200q: %s", i, l.Digest, entry, what)
	}
	return apierr.Invalidf("layers", "layer %d (%s): %s", i, l.Digest, what)
}
