package fleet

import (
	"context"
	"slices"
	"strings"

	"github.com/giantswarm/vm-manager/gen/apierr"
	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
)

// Attestation is AttestationService at fleet level. Verdicts are the VM's
// node's; image policies are fleet-wide: an import, a clear and golden
// values recorded from a VM apply on every node, so a VM attests alike
// wherever it is placed.
type Attestation struct {
	attestationv1.UnimplementedAttestationServiceServer
	r *Router
}

// NewAttestation returns the fleet's AttestationService over r.
func NewAttestation(r *Router) *Attestation { return &Attestation{r: r} }

func (a *Attestation) GetVirtualMachineAttestation(ctx context.Context, req *attestationv1.GetVirtualMachineAttestationRequest) (*attestationv1.Attestation, error) {
	return onVM(ctx, a.r, req.GetId(), func(ctx context.Context, n *node) (*attestationv1.Attestation, error) {
		return n.at.GetVirtualMachineAttestation(ctx, req)
	})
}

// ListImagePolicies is the union of the nodes' policies by image, the
// lowest-index node's copy of each; a node that does not answer is a
// warning.
func (a *Attestation) ListImagePolicies(ctx context.Context, req *attestationv1.ListImagePoliciesRequest) (*attestationv1.ListImagePoliciesResponse, error) {
	out := &attestationv1.ListImagePoliciesResponse{}
	seen := map[string]bool{}
	for _, x := range fanOut(ctx, a.r, func(ctx context.Context, n *node) (*attestationv1.ListImagePoliciesResponse, error) {
		return n.at.ListImagePolicies(ctx, req)
	}) {
		if x.err != nil {
			out.Warnings = append(out.Warnings, warning(x.node, x.err))
			continue
		}
		for _, p := range x.val.GetPolicies() {
			if !seen[p.GetImage()] {
				seen[p.GetImage()] = true
				out.Policies = append(out.Policies, p)
			}
		}
	}
	slices.SortFunc(out.Policies, func(x, y *attestationv1.ImagePolicy) int { return strings.Compare(x.GetImage(), y.GetImage()) })
	return out, nil
}

func (a *Attestation) GetImagePolicy(ctx context.Context, req *attestationv1.GetImagePolicyRequest) (*attestationv1.ImagePolicy, error) {
	return firstFound(ctx, a.r, "", func(ctx context.Context, n *node) (*attestationv1.ImagePolicy, error) {
		return n.at.GetImagePolicy(ctx, req)
	})
}

// ImportImagePolicy imports on every node; a node that fails is named in
// the error (the import is idempotent: retry it).
func (a *Attestation) ImportImagePolicy(ctx context.Context, req *attestationv1.ImportImagePolicyRequest) (*attestationv1.ImagePolicy, error) {
	return everywhere(ctx, a.r, "", func(ctx context.Context, n *node) (*attestationv1.ImagePolicy, error) {
		return n.at.ImportImagePolicy(ctx, req)
	})
}

func (a *Attestation) ClearGolden(ctx context.Context, req *attestationv1.ClearGoldenRequest) (*attestationv1.ImagePolicy, error) {
	return everywhere(ctx, a.r, "", func(ctx context.Context, n *node) (*attestationv1.ImagePolicy, error) {
		return n.at.ClearGolden(ctx, req)
	})
}

// RecordGolden records on the VM's node (its verified quote is there),
// then imports the resulting document, golden values included, on every
// other node.
func (a *Attestation) RecordGolden(ctx context.Context, req *attestationv1.RecordGoldenRequest) (*attestationv1.ImagePolicy, error) {
	src, err := a.r.forVM(req.GetFromVm())
	if err != nil {
		return nil, err
	}
	p, err := src.at.RecordGolden(ctx, req)
	if err != nil {
		return nil, nodeErr(ctx, src, err)
	}
	_, err = everywhere(ctx, a.r, "", func(ctx context.Context, n *node) (*attestationv1.ImagePolicy, error) {
		if n.Index == src.Index {
			return p, nil
		}
		return n.at.ImportImagePolicy(ctx, &attestationv1.ImportImagePolicyRequest{Image: req.GetImage(), Document: p.GetDocument()})
	})
	if err != nil {
		return nil, apierr.Errorf(apierr.CodeOf(err), "recorded on node %s, but not copied everywhere: %s", src.Name, apierr.MessageOf(err))
	}
	return p, nil
}

// GetAttestationStatus is the first answering node's: every node of a
// fleet is meant to run with the same mode.
func (a *Attestation) GetAttestationStatus(ctx context.Context, req *attestationv1.GetAttestationStatusRequest) (*attestationv1.AttestationStatus, error) {
	return firstFound(ctx, a.r, "", func(ctx context.Context, n *node) (*attestationv1.AttestationStatus, error) {
		return n.at.GetAttestationStatus(ctx, req)
	})
}
