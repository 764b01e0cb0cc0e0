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
	"fmt"
	"log/slog"
	"net/http"
	"os"

	"oras.land/oras-go/v2/registry"
	"oras.land/oras-go/v2/registry/remote"
	"oras.land/oras-go/v2/registry/remote/auth"
	"oras.land/oras-go/v2/registry/remote/credentials"
	"oras.land/oras-go/v2/registry/remote/retry"

	"github.com/giantswarm/vm-manager/pkg/buildinfo"
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

// Repository is the registry repository of ref, with the Docker config's
// credentials (or opts.Credential) and the project's User-Agent: what pulls,
// pushes and OCI image imports talk to.
func Repository(ref string, opts Options) (*remote.Repository, registry.Reference, error) {
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
