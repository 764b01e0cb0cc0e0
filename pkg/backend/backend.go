// Package backend is how a backend process (hypervisor, attestation) starts:
// the identity verifier its server checks tokens with, and its state
// directory locked against a second process of the same name.
package backend

import (
	"context"
	"log/slog"

	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/statedir"
)

// Backend is a started backend's identity and state directory.
type Backend struct {
	// Verifier checks the callers' tokens (nil-safe when identity is off).
	Verifier *identity.Verifier
	lock     *statedir.Lock
}

// Open sets up identity (discovering the issuer when one is configured) and
// takes the state directory's lock for name. Close releases it.
func Open(ctx context.Context, name, stateDir string, id identity.Config, log *slog.Logger) (*Backend, error) {
	if id.Log == nil {
		id.Log = log
	}
	v, err := identity.New(ctx, id)
	if err != nil {
		return nil, err
	}
	lock, err := statedir.Acquire(stateDir, name)
	if err != nil {
		return nil, err
	}
	return &Backend{Verifier: v, lock: lock}, nil
}

// Close releases the state directory.
func (b *Backend) Close() error { return b.lock.Release() }
