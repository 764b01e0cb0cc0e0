package main

import (
	"archive/tar"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/google/go-containerregistry/pkg/v1/validate"
)

type tarFile struct {
	mode     int64
	uid, gid int
	data     string
	dir      bool
}

func build(t *testing.T, name string, ca bool) (string, string) {
	t.Helper()
	tmp := t.TempDir()
	bin := filepath.Join(tmp, "vmm-"+name)
	if err := os.WriteFile(bin, []byte("\x7fELF dummy "+name), 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := Config{Name: name, Binary: bin, Version: "v1.2.3", Revision: "abc1234", Arch: "amd64", Epoch: time.Unix(0, 0).UTC()}
	if ca {
		cfg.CABundle = filepath.Join(tmp, "ca.pem")
		if err := os.WriteFile(cfg.CABundle, []byte("-----BEGIN CERTIFICATE-----\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	img, err := Build(cfg)
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(tmp, "images", name)
	if err := Write(img, out, cfg.Version, cfg.Arch); err != nil {
		t.Fatal(err)
	}
	d, _ := img.Digest()
	return out, d.String()
}

func TestImage(t *testing.T) {
	for _, c := range []struct {
		name  string
		ports []string
		env   string
	}{
		{"gateway", []string{"8080/tcp"}, "VM_MANAGER_LISTEN=:8080"},
		{"attestation", nil, "VM_MANAGER_STATE_DIR=/var/lib/vm-manager"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir, digest := build(t, c.name, true)

			// The layout reads back: one image, tagged, for linux/amd64.
			idx, err := layout.ImageIndexFromPath(dir)
			if err != nil {
				t.Fatal(err)
			}
			im, err := idx.IndexManifest()
			if err != nil {
				t.Fatal(err)
			}
			if len(im.Manifests) != 1 {
				t.Fatalf("%d manifests", len(im.Manifests))
			}
			desc := im.Manifests[0]
			if desc.Digest.String() != digest || desc.MediaType != types.OCIManifestSchema1 ||
				desc.Annotations["org.opencontainers.image.ref.name"] != "v1.2.3" ||
				desc.Platform == nil || desc.Platform.OS != "linux" || desc.Platform.Architecture != "amd64" {
				t.Errorf("index entry %+v", desc)
			}
			img, err := idx.Image(desc.Digest)
			if err != nil {
				t.Fatal(err)
			}
			// What was written (re-read from the layout) is a valid image:
			// digests, sizes and diff IDs agree.
			if err := validate.Image(img); err != nil {
				t.Fatalf("validate: %v", err)
			}

			cf, err := img.ConfigFile()
			if err != nil {
				t.Fatal(err)
			}
			entry := "/usr/local/bin/vmm-" + c.name
			if !reflect.DeepEqual(cf.Config.Entrypoint, []string{entry, "serve"}) || cf.Config.Cmd != nil {
				t.Errorf("entrypoint %q cmd %q", cf.Config.Entrypoint, cf.Config.Cmd)
			}
			if cf.Config.User != "65532:65532" {
				t.Errorf("user %q", cf.Config.User)
			}
			if cf.OS != "linux" || cf.Architecture != "amd64" {
				t.Errorf("platform %s/%s", cf.OS, cf.Architecture)
			}
			for _, want := range []string{"PATH=/usr/local/bin:/usr/bin:/bin", "VM_MANAGER_RUN_DIR=/run/vm-manager", c.env} {
				if !slices.Contains(cf.Config.Env, want) {
					t.Errorf("env %q lacks %q", cf.Config.Env, want)
				}
			}
			var ports []string
			for p := range cf.Config.ExposedPorts {
				ports = append(ports, p)
			}
			if !reflect.DeepEqual(ports, c.ports) {
				t.Errorf("exposed ports %q, want %q", ports, c.ports)
			}
			if l := cf.Config.Labels; l["org.opencontainers.image.version"] != "v1.2.3" || l["org.opencontainers.image.revision"] != "abc1234" {
				t.Errorf("labels %v", l)
			}

			layers, err := img.Layers()
			if err != nil || len(layers) != 1 {
				t.Fatalf("layers: %d %v", len(layers), err)
			}
			if mt, _ := layers[0].MediaType(); mt != types.OCILayer {
				t.Errorf("layer media type %s", mt)
			}
			files := readLayer(t, layers[0])
			want := map[string]tarFile{
				entry[1:]:                           {mode: 0o755, data: "\x7fELF dummy " + c.name},
				"etc/passwd":                        {mode: 0o644},
				"etc/group":                         {mode: 0o644},
				"etc/ssl/certs/ca-certificates.crt": {mode: 0o644, data: "-----BEGIN CERTIFICATE-----\n"},
				"tmp/":                              {mode: 0o1777, dir: true},
				"home/nonroot/":                     {mode: 0o700, uid: 65532, gid: 65532, dir: true},
				"run/vm-manager/":                   {mode: 0o700, uid: 65532, gid: 65532, dir: true},
				"var/lib/vm-manager/":               {mode: 0o700, uid: 65532, gid: 65532, dir: true},
			}
			for name, w := range want {
				g, ok := files[name]
				if !ok {
					t.Errorf("layer lacks %s", name)
					continue
				}
				if w.data == "" {
					w.data = g.data
				}
				if g != w {
					t.Errorf("%s: %+v, want %+v", name, g, w)
				}
			}
			if !strings.Contains(files["etc/passwd"].data, "nonroot:x:65532:65532:") {
				t.Errorf("/etc/passwd: %q", files["etc/passwd"].data)
			}

			// Reproducible: the same inputs give the same digest.
			if _, again := build(t, c.name, true); again != digest {
				t.Errorf("second build: %s, want %s", again, digest)
			}
		})
	}
}

func readLayer(t *testing.T, l interface{ Uncompressed() (io.ReadCloser, error) }) map[string]tarFile {
	t.Helper()
	rc, err := l.Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	out := map[string]tarFile{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if !h.ModTime.Equal(time.Unix(0, 0)) {
			t.Errorf("%s: mtime %v", h.Name, h.ModTime)
		}
		out[h.Name] = tarFile{mode: h.Mode, uid: h.Uid, gid: h.Gid, data: string(b), dir: h.Typeflag == tar.TypeDir}
	}
}

func TestRefusesHypervisor(t *testing.T) {
	_, err := Build(Config{Name: "hypervisor"})
	if err == nil || !strings.Contains(err.Error(), "docker build --target hypervisor") {
		t.Errorf("err = %v", err)
	}
	if _, err := Build(Config{Name: "nope"}); err == nil {
		t.Error("unknown image accepted")
	}
}

// The command, as make images runs it.
func TestCommand(t *testing.T) {
	if testing.Short() {
		t.Skip("go run")
	}
	tmp := t.TempDir()
	bin := filepath.Join(tmp, "vmm-gateway")
	if err := os.WriteFile(bin, []byte("bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(tmp, "out", "gateway")
	for range 2 { // a second run replaces the layout
		cmd := exec.Command("go", "run", ".", "-name", "gateway", "-binary", bin, "-out", out, "-version", "v9", "-revision", "r", "-ca-bundle", "")
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%v\n%s", err, b)
		}
	}
	idx, err := layout.ImageIndexFromPath(out)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil || len(im.Manifests) != 1 {
		t.Fatalf("index: %v %v", im, err)
	}
}
