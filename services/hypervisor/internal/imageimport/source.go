package imageimport

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"oras.land/oras-go/v2"
	"oras.land/oras-go/v2/content/oci"
	"oras.land/oras-go/v2/registry"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/guestimage"
)

// LayoutPrefix starts a source that is an OCI layout directory on the host.
const LayoutPrefix = "oci-layout:"

// MaxSourceLen bounds a source string.
const MaxSourceLen = 1024

// source is a parsed ImportImageRequest.source.
type source struct {
	// layout is the OCI layout directory, or "" for a registry.
	layout string
	// ref is the registry reference (registry sources).
	ref registry.Reference
	// tag is what to resolve in the target: a tag or a digest.
	tag string
	// name is the default catalog id: the repository's last element, or the
	// layout directory's name.
	name string
}

func parseSource(s string) (source, error) {
	if s == "" {
		return source{}, apierr.Invalidf("source", "source is required: a registry reference (host/repository:tag) or %s<dir>[:<tag>]", LayoutPrefix)
	}
	if len(s) > MaxSourceLen || strings.ContainsAny(s, "\x00\n\r\t ") {
		return source{}, apierr.Invalidf("source", "source %.80q: at most %d characters, no spaces or control characters", s, MaxSourceLen)
	}
	if dir, ok := strings.CutPrefix(s, LayoutPrefix); ok {
		tag := "latest"
		if i := strings.LastIndex(dir, ":"); i >= 0 && !strings.Contains(dir[i:], "/") {
			dir, tag = dir[:i], dir[i+1:]
		}
		if !filepath.IsAbs(dir) || tag == "" {
			return source{}, apierr.Invalidf("source", "source %q: an OCI layout is %s<absolute dir>[:<tag>]", s, LayoutPrefix)
		}
		return source{layout: filepath.Clean(dir), tag: tag, name: filepath.Base(dir)}, nil
	}
	r, err := registry.ParseReference(s)
	if err != nil {
		return source{}, apierr.Invalidf("source", "source %q is not a registry reference (host/repository:tag or @sha256:…): %v", s, err)
	}
	tag := r.Reference
	if tag == "" {
		tag = "latest"
		r.Reference = tag
	}
	return source{ref: r, tag: tag, name: r.Repository[strings.LastIndex(r.Repository, "/")+1:]}, nil
}

// target opens the source read-only.
func (im *Importer) target(ctx context.Context, src source) (oras.ReadOnlyTarget, error) {
	if src.layout != "" {
		if fi, err := os.Stat(filepath.Join(src.layout, "index.json")); err != nil || fi.IsDir() {
			return nil, apierr.Errorf(apierr.NotFound, "source %s%s: no OCI layout there (index.json)", LayoutPrefix, src.layout)
		}
		store, err := oci.NewFromFS(ctx, os.DirFS(src.layout))
		if err != nil {
			return nil, apierr.Invalidf("source", "OCI layout %s: %v", src.layout, err)
		}
		return store, nil
	}
	repo, _, err := guestimage.Repository(src.ref.String(), guestimage.Options{
		PlainHTTP:  im.cfg.PlainHTTP || loopback(src.ref.Registry),
		Credential: im.cfg.Credential,
	})
	if err != nil {
		return nil, apierr.Invalidf("source", "%v", err)
	}
	return repo, nil
}

// loopback says whether a registry host is this machine's loopback: talked
// to in plain HTTP, as Docker treats such registries.
func loopback(hostport string) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

var notRefChar = regexp.MustCompile(`[^A-Za-z0-9.+-]+`)

// refPart makes a catalog id or version out of a repository name or tag:
// what the catalog cannot name becomes '-' ('_' too: it splits id from
// version).
func refPart(s string) string {
	return strings.Trim(notRefChar.ReplaceAllString(s, "-"), "-.")
}
