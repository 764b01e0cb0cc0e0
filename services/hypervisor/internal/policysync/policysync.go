// Package policysync hands the image catalog's policy.json files to the
// attestation service, which owns policy: at start, and again whenever a
// file changes.
package policysync

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"log/slog"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/protobuf/types/known/structpb"
)

// Catalog is the image catalog's view of the policies.
type Catalog interface {
	List() []*hypervisorv1.Image
	PolicyDocument(ref string) ([]byte, bool)
}

// Store remembers which document attestation holds for each image.
type Store interface {
	PolicySynced(ref string) (string, error)
	SetPolicySynced(ref, digest string) error
}

// Run hands every catalog image's policy.json to attestation, which owns
// policy. A document is imported when it is new or changed since the last
// hand-over, so an operator's own import is not overwritten on every start.
// Attestation may be down or restarting: retry until everything is synced.
func Run(ctx context.Context, log *slog.Logger, cat Catalog, st Store, client attestationv1.VerifierServiceClient) {
	for delay := 500 * time.Millisecond; ; delay = min(delay*2, 10*time.Second) {
		pending := 0
		for _, img := range cat.List() {
			doc, ok := cat.PolicyDocument(img.GetRef())
			if !ok {
				continue
			}
			sum := sha256.Sum256(doc)
			digest := hex.EncodeToString(sum[:])
			if prev, _ := st.PolicySynced(img.GetRef()); prev == digest {
				continue
			}
			s := &structpb.Struct{}
			if err := s.UnmarshalJSON(doc); err != nil {
				log.Warn("image policy is not a JSON object; not imported", "image", img.GetRef(), "error", err)
				continue
			}
			callCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
			_, err := client.SyncImagePolicy(callCtx, &attestationv1.SyncImagePolicyRequest{Image: img.GetRef(), Document: s})
			cancel()
			switch {
			case err == nil:
				log.Info("image policy imported into attestation", "image", img.GetRef(), "sha256", digest)
				_ = st.SetPolicySynced(img.GetRef(), digest)
			case apierr.CodeOf(err) == apierr.InvalidRequest:
				log.Warn("image policy rejected by attestation", "image", img.GetRef(), "error", apierr.MessageOf(err))
				_ = st.SetPolicySynced(img.GetRef(), digest) // the same bytes will not pass next time either
			default:
				pending++
				log.Debug("image policy import pending", "image", img.GetRef(), "error", err)
			}
		}
		if pending == 0 {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
	}
}

// Syncer hands one image's policy to attestation now (an import: the image
// must not be offered before attestation holds its policy).
type Syncer struct {
	Store  Store
	Client attestationv1.VerifierServiceClient
}

// Sync imports doc as ref's policy and records it as handed over.
func (s Syncer) Sync(ctx context.Context, ref string, doc []byte) error {
	st := &structpb.Struct{}
	if err := st.UnmarshalJSON(doc); err != nil {
		return err
	}
	if _, err := s.Client.SyncImagePolicy(ctx, &attestationv1.SyncImagePolicyRequest{Image: ref, Document: st}); err != nil {
		return err
	}
	sum := sha256.Sum256(doc)
	return s.Store.SetPolicySynced(ref, hex.EncodeToString(sum[:]))
}
