// Command mkimage builds the gateway and attestation container images as OCI
// image layouts without a Docker daemon: one layer holding the static binary
// at /usr/local/bin/vmm-<name>, a CA bundle, /etc/passwd and /etc/group with
// the distroless "nonroot" user (65532), /tmp and the state and run
// directories, on an empty base. The hypervisor image needs QEMU, swtpm and
// OVMF from Debian: it is built from deploy/docker/Dockerfile with a Docker
// engine.
//
//	mkimage -name gateway -binary bin/vmm-gateway -out build/images/gateway -version v1 -revision abc
//
// The layout can be pushed with `crane push build/images/gateway REF` or
// `skopeo copy oci:build/images/gateway docker://REF`.
package main

import (
	"archive/tar"
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"runtime"
	"strconv"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/partial"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// NonRoot is the uid and gid the images run as (distroless' "nonroot").
const NonRoot = 65532

// DefaultCABundle is where Debian keeps the system CA bundle; Go's
// crypto/x509 reads the same path in the image.
const DefaultCABundle = "/etc/ssl/certs/ca-certificates.crt"

// Config describes one image.
type Config struct {
	Name     string // gateway or attestation
	Binary   string // the static vmm-<name> binary
	Version  string // org.opencontainers.image.version and the layout's ref.name
	Revision string // org.opencontainers.image.revision
	Arch     string // GOARCH of the binary
	CABundle string // PEM bundle installed as /etc/ssl/certs/ca-certificates.crt; empty: none
	// Epoch is the timestamp of the files and the config; images built from
	// the same inputs are identical.
	Epoch time.Time
}

// service is what differs between the images.
type service struct {
	ports []string
	env   []string
}

var services = map[string]service{
	"gateway": {
		ports: []string{"8080/tcp"},
		// Reachable from outside the container; without --oidc-issuer the
		// gateway refuses a non-loopback address unless
		// --allow-anonymous-non-loopback is given.
		env: []string{"VM_MANAGER_LISTEN=:8080"},
	},
	"attestation": {
		env: []string{"VM_MANAGER_STATE_DIR=/var/lib/vm-manager"},
	},
}

// Build returns the image for cfg.
func Build(cfg Config) (v1.Image, error) {
	svc, ok := services[cfg.Name]
	if !ok {
		if cfg.Name == "hypervisor" {
			return nil, errors.New("the hypervisor image needs QEMU, swtpm and OVMF from Debian: build it with `docker build --target hypervisor -f deploy/docker/Dockerfile .`")
		}
		return nil, fmt.Errorf("unknown image %q: want gateway or attestation", cfg.Name)
	}
	bin, err := os.ReadFile(cfg.Binary)
	if err != nil {
		return nil, err
	}
	var ca []byte
	if cfg.CABundle != "" {
		if ca, err = os.ReadFile(cfg.CABundle); err != nil {
			return nil, err
		}
	}
	entrypoint := "/usr/local/bin/vmm-" + cfg.Name
	tarBytes, err := rootfs(entrypoint, bin, ca, cfg.Epoch)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(tarBytes)), nil
	}, tarball.WithMediaType(types.OCILayer), tarball.WithCompressedCaching)
	if err != nil {
		return nil, err
	}

	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.Append(img, mutate.Addendum{
		Layer: layer,
		History: v1.History{
			Created:   v1.Time{Time: cfg.Epoch},
			CreatedBy: "deploy/mkimage: " + entrypoint,
			Comment:   "static binary, CA bundle, nonroot user",
		},
	})
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS = "linux"
	cf.Architecture = cfg.Arch
	cf.Created = v1.Time{Time: cfg.Epoch}
	cf.Author = "vm-manager"
	env := append([]string{
		"PATH=/usr/local/bin:/usr/bin:/bin",
		"HOME=/home/nonroot",
		"VM_MANAGER_RUN_DIR=/run/vm-manager",
	}, svc.env...)
	cf.Config = v1.Config{
		Entrypoint: []string{entrypoint, "serve"},
		User:       strconv.Itoa(NonRoot) + ":" + strconv.Itoa(NonRoot),
		Env:        env,
		WorkingDir: "/",
		Labels: map[string]string{
			"org.opencontainers.image.title":    "vmm-" + cfg.Name,
			"org.opencontainers.image.version":  cfg.Version,
			"org.opencontainers.image.revision": cfg.Revision,
			"org.opencontainers.image.source":   "https://github.com/giantswarm/vm-manager",
		},
	}
	if len(svc.ports) > 0 {
		cf.Config.ExposedPorts = map[string]struct{}{}
		for _, p := range svc.ports {
			cf.Config.ExposedPorts[p] = struct{}{}
		}
	}
	return mutate.ConfigFile(img, cf)
}

// rootfs is the layer's tar: directories first, then files, all owned by
// root except the nonroot user's directories.
func rootfs(entrypoint string, bin, ca []byte, epoch time.Time) ([]byte, error) {
	type entry struct {
		name string
		mode int64
		uid  int
		data []byte
		dir  bool
	}
	dir := func(name string, mode int64, uid int) entry {
		return entry{name: name, mode: mode, uid: uid, dir: true}
	}
	file := func(name string, mode int64, data []byte) entry {
		return entry{name: name, mode: mode, data: data}
	}
	entries := []entry{
		dir("etc/", 0o755, 0),
		file("etc/passwd", 0o644, []byte("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n")),
		file("etc/group", 0o644, []byte("root:x:0:\nnonroot:x:65532:\n")),
	}
	if ca != nil {
		entries = append(entries,
			dir("etc/ssl/", 0o755, 0),
			dir("etc/ssl/certs/", 0o755, 0),
			file("etc/ssl/certs/ca-certificates.crt", 0o644, ca))
	}
	entries = append(entries,
		dir("home/", 0o755, 0),
		dir("home/nonroot/", 0o700, NonRoot),
		dir("root/", 0o700, 0),
		dir("run/", 0o755, 0),
		dir("run/vm-manager/", 0o700, NonRoot),
		dir("tmp/", 0o1777, 0),
		dir("usr/", 0o755, 0),
		dir("usr/local/", 0o755, 0),
		dir("usr/local/bin/", 0o755, 0),
		file(entrypoint[1:], 0o755, bin),
		dir("var/", 0o755, 0),
		dir("var/lib/", 0o755, 0),
		dir("var/lib/vm-manager/", 0o700, NonRoot),
	)
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		h := &tar.Header{
			Name:     e.name,
			Mode:     e.mode,
			Uid:      e.uid,
			Gid:      e.uid,
			ModTime:  epoch,
			Format:   tar.FormatPAX,
			Typeflag: tar.TypeReg,
			Size:     int64(len(e.data)),
		}
		if e.dir {
			h.Typeflag, h.Size = tar.TypeDir, 0
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(e.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// Write replaces dir with an OCI image layout holding img, tagged version.
func Write(img v1.Image, dir, version, arch string) error {
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	if err := p.WriteImage(img); err != nil {
		return err
	}
	desc, err := partial.Descriptor(img)
	if err != nil {
		return err
	}
	// An image, not an artifact: no artifactType on its index entry.
	desc.ArtifactType = ""
	desc.Annotations = map[string]string{"org.opencontainers.image.ref.name": version}
	desc.Platform = &v1.Platform{OS: "linux", Architecture: arch}
	return p.AppendDescriptor(*desc)
}

func main() {
	var cfg Config
	flag.StringVar(&cfg.Name, "name", "", "image: gateway or attestation")
	flag.StringVar(&cfg.Binary, "binary", "", "the static binary (default bin/vmm-<name>)")
	out := flag.String("out", "", "OCI layout directory to (re)create (default build/images/<name>)")
	flag.StringVar(&cfg.Version, "version", "dev", "org.opencontainers.image.version label and the layout's ref.name")
	flag.StringVar(&cfg.Revision, "revision", "unknown", "org.opencontainers.image.revision label")
	flag.StringVar(&cfg.Arch, "arch", runtime.GOARCH, "architecture of the binary")
	ca := flag.String("ca-bundle", DefaultCABundle, "CA bundle to install as "+DefaultCABundle+" (empty: none; a missing default is skipped with a warning)")
	epoch := flag.Int64("source-date-epoch", 0, "timestamp of the files and the config, seconds since 1970 (default $SOURCE_DATE_EPOCH, else 0)")
	flag.Parse()
	if flag.NArg() > 0 || cfg.Name == "" {
		fmt.Fprintln(os.Stderr, "usage: mkimage -name gateway|attestation [-binary FILE] [-out DIR] [-version V] [-revision R]")
		os.Exit(2)
	}
	if cfg.Binary == "" {
		cfg.Binary = "bin/vmm-" + cfg.Name
	}
	if *out == "" {
		*out = "build/images/" + cfg.Name
	}
	cfg.CABundle = *ca
	if *ca == DefaultCABundle {
		if _, err := os.Stat(*ca); errors.Is(err, fs.ErrNotExist) {
			fmt.Fprintf(os.Stderr, "mkimage: warning: %s missing; the image has no CA bundle (OIDC issuers over HTTPS will fail)\n", *ca)
			cfg.CABundle = ""
		}
	}
	sde := *epoch
	if sde == 0 {
		if v := os.Getenv("SOURCE_DATE_EPOCH"); v != "" {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				fmt.Fprintf(os.Stderr, "mkimage: SOURCE_DATE_EPOCH=%q: %v\n", v, err)
				os.Exit(2)
			}
			sde = n
		}
	}
	cfg.Epoch = time.Unix(sde, 0).UTC()

	img, err := Build(cfg)
	if err == nil {
		err = Write(img, *out, cfg.Version, cfg.Arch)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "mkimage %s: %v\n", cfg.Name, err)
		os.Exit(1)
	}
	d, _ := img.Digest()
	fmt.Printf("%s: %s (%s, %s)\n", cfg.Name, *out, d, cfg.Version)
}
