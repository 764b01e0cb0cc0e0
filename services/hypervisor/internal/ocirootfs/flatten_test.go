package ocirootfs

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"strings"
	"testing"

	"github.com/klauspost/compress/zstd"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// entry is one tar entry of a test layer.
type entry struct {
	name, body, link string
	typ              byte
	mode             int64
	uid              int
	pax              map[string]string
}

func file(name, body string) entry {
	return entry{name: name, body: body, typ: tar.TypeReg, mode: 0o644}
}
func dir(name string) entry { return entry{name: name, typ: tar.TypeDir, mode: 0o755} }

// layer is a tar+gzip layer blob of the entries, with its digest.
func layer(t *testing.T, entries ...entry) Layer {
	t.Helper()
	var tb bytes.Buffer
	tw := tar.NewWriter(&tb)
	for _, e := range entries {
		h := &tar.Header{Name: e.name, Typeflag: e.typ, Mode: e.mode, Uid: e.uid, Linkname: e.link, Size: int64(len(e.body)), PAXRecords: e.pax}
		if e.typ != tar.TypeReg {
			h.Size = 0
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if e.typ == tar.TypeReg {
			tw.Write([]byte(e.body))
		}
	}
	tw.Close()
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(tb.Bytes())
	zw.Close()
	blob := gz.Bytes()
	sum := sha256.Sum256(blob)
	return Layer{Digest: "sha256:" + hex.EncodeToString(sum[:]), MediaType: ocispec.MediaTypeImageLayerGzip,
		Open: func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(blob)), nil }}
}

// read is the flattened root: each path's header and content.
func read(t *testing.T, b []byte) (map[string]*tar.Header, map[string]string) {
	t.Helper()
	hdrs, bodies := map[string]*tar.Header{}, map[string]string{}
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if _, dup := hdrs[h.Name]; dup {
			t.Errorf("%s twice", h.Name)
		}
		c, _ := io.ReadAll(tr)
		hdrs[h.Name], bodies[h.Name] = h, string(c)
	}
	return hdrs, bodies
}

// The image spec's changesets: a file replaced, one whited out, an opaque
// directory hiding the lower layer's contents (not its own layer's), a hard
// link, a directory replaced by a file, modes, owners and xattrs kept.
func TestFlattenChangesets(t *testing.T) {
	owned := file("etc/shadow", "s")
	owned.uid, owned.mode = 42, 0o600
	tagged := file("usr/bin/tool", "t")
	tagged.pax = map[string]string{"SCHILY.xattr.security.capability": "cap"}
	base := layer(t, dir("etc"), file("etc/passwd", "A"), owned, file("etc/group", "g"), dir("usr"), dir("usr/bin"), tagged,
		dir("var"), dir("var/cache"), file("var/cache/a", "a"), file("var/cache/b", "b"), dir("opt"), file("opt/x", "x"))
	top := layer(t, file("etc/passwd", "B"), file("etc/.wh.group", ""), file("var/cache/c", "c"), file("var/cache/.wh..wh..opq", ""),
		entry{name: "usr/bin/tool2", typ: tar.TypeLink, link: "usr/bin/tool"}, file("opt", "now a file"))
	var out bytes.Buffer
	st, err := Flatten(context.Background(), []Layer{base, top}, Limits{}, &out)
	if err != nil {
		t.Fatal(err)
	}
	hdrs, bodies := read(t, out.Bytes())
	if bodies["etc/passwd"] != "B" {
		t.Errorf("etc/passwd %q, want the upper layer's", bodies["etc/passwd"])
	}
	for _, gone := range []string{"etc/group", "var/cache/a", "var/cache/b", "opt/x", "opt/"} {
		if _, ok := hdrs[gone]; ok {
			t.Errorf("%s is in the root", gone)
		}
	}
	if bodies["var/cache/c"] != "c" || bodies["opt"] != "now a file" {
		t.Errorf("upper layer's entries: %q %q", bodies["var/cache/c"], bodies["opt"])
	}
	if h := hdrs["etc/shadow"]; h == nil || h.Uid != 42 || h.Mode != 0o600 {
		t.Errorf("etc/shadow: %+v", h)
	}
	if h := hdrs["usr/bin/tool"]; h == nil || h.PAXRecords["SCHILY.xattr.security.capability"] != "cap" {
		t.Errorf("xattr lost: %+v", h)
	}
	if h := hdrs["usr/bin/tool2"]; h == nil || h.Typeflag != tar.TypeLink || h.Linkname != "usr/bin/tool" {
		t.Errorf("hard link: %+v", h)
	}
	if st.Entries != len(hdrs) {
		t.Errorf("stats %+v, %d entries written", st, len(hdrs))
	}
}

// Broken and hostile layers are refused with invalid_request naming the
// layer and the entry, and nothing is written.
func TestFlattenRefusesHostileLayers(t *testing.T) {
	good := layer(t, dir("etc"), file("etc/passwd", "A"))
	tampered := good
	tampered.Digest = "sha256:" + strings.Repeat("0", 64)
	for _, c := range []struct {
		name   string
		layers []Layer
		want   string
	}{
		{"path traversal", []Layer{layer(t, file("../../etc/cron.d/x", "boom"))}, `entry "../../etc/cron.d/x": the path climbs out of the root`},
		{"device node", []Layer{layer(t, entry{name: "dev/sda", typ: tar.TypeBlock, mode: 0o600})}, `entry "dev/sda": a device node`},
		{"symlink above the root", []Layer{layer(t, dir("a"), entry{name: "a/up", typ: tar.TypeSymlink, link: "../../../host"})}, `entry "a/up": a symlink to "../../../host" points above the root`},
		{"entry under a symlink", []Layer{layer(t, entry{name: "lib", typ: tar.TypeSymlink, link: "/"}), layer(t, file("lib/x", "x"))}, `layer 1 (sha256:`},
		{"digest mismatch", []Layer{good, tampered}, `layer 1 (sha256:0000000000000000000000000000000000000000000000000000000000000000): its content's digest is sha256:`},
		{"hard link to nothing", []Layer{layer(t, entry{name: "x", typ: tar.TypeLink, link: "etc/shadow"})}, `a hard link to "etc/shadow", which is no file of the image`},
		{"not gzip", []Layer{{Digest: "sha256:" + hex.EncodeToString(func() []byte { s := sha256.Sum256([]byte("junk")); return s[:] }()), MediaType: ocispec.MediaTypeImageLayerGzip,
			Open: func() (io.ReadCloser, error) { return io.NopCloser(strings.NewReader("junk")), nil }}}, "not gzip"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var out bytes.Buffer
			_, err := Flatten(context.Background(), c.layers, Limits{}, &out)
			if apierr.CodeOf(err) != apierr.InvalidRequest || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("%v, want invalid_request with %q", err, c.want)
			}
			if out.Len() != 0 {
				t.Errorf("%d bytes written", out.Len())
			}
		})
	}
}

// The bounds: contents summed over the final tree, and entries.
func TestFlattenBounds(t *testing.T) {
	big := layer(t, file("a", strings.Repeat("x", 600)), file("b", strings.Repeat("y", 600)))
	_, err := Flatten(context.Background(), []Layer{big}, Limits{MaxBytes: 1000}, io.Discard)
	if apierr.CodeOf(err) != apierr.ResourceExhausted {
		t.Fatalf("over MaxBytes: %v", err)
	}
	// A whiteout gives its bytes back: 600 in the final tree.
	shrunk := layer(t, file(".wh.b", ""))
	if _, err := Flatten(context.Background(), []Layer{big, shrunk}, Limits{MaxBytes: 1300}, io.Discard); err != nil {
		t.Fatalf("within MaxBytes after a whiteout: %v", err)
	}
	_, err = Flatten(context.Background(), []Layer{big}, Limits{MaxEntries: 1}, io.Discard)
	if apierr.CodeOf(err) != apierr.ResourceExhausted {
		t.Fatalf("over MaxEntries: %v", err)
	}
}

// zstdOf is l re-compressed as tar+zstd.
func zstdOf(t *testing.T, l Layer) Layer {
	t.Helper()
	rc, _ := l.Open()
	zr, err := gzip.NewReader(rc)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(zr)
	var zb bytes.Buffer
	zw, _ := zstd.NewWriter(&zb)
	zw.Write(raw)
	zw.Close()
	blob := zb.Bytes()
	sum := sha256.Sum256(blob)
	return Layer{Digest: "sha256:" + hex.EncodeToString(sum[:]), MediaType: ocispec.MediaTypeImageLayerZstd,
		Open: func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(blob)), nil }}
}

// A tar+zstd layer flattens as its tar+gzip twin does; a zstd layer that
// is not zstd is refused naming the layer.
func TestZstdLayer(t *testing.T) {
	base := layer(t, dir("etc"), entry{name: "etc/os-release", typ: tar.TypeReg, mode: 0o644, body: "ID=test\n"})
	top := layer(t, entry{name: "etc/.wh.os-release", typ: tar.TypeReg, mode: 0o644}, entry{name: "app", typ: tar.TypeReg, mode: 0o755, body: "run"})
	var gz, zs bytes.Buffer
	if _, err := Flatten(context.Background(), []Layer{base, top}, Limits{}, &gz); err != nil {
		t.Fatal(err)
	}
	if _, err := Flatten(context.Background(), []Layer{zstdOf(t, base), zstdOf(t, top)}, Limits{}, &zs); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(gz.Bytes(), zs.Bytes()) {
		t.Error("the zstd layers flatten to another root than their gzip twins")
	}
	bad := base
	bad.MediaType = ocispec.MediaTypeImageLayerZstd
	if _, err := Flatten(context.Background(), []Layer{bad}, Limits{}, io.Discard); apierr.CodeOf(err) != apierr.InvalidRequest || !strings.Contains(err.Error(), bad.Digest) {
		t.Errorf("gzip bytes as zstd: %v", err)
	}
}
