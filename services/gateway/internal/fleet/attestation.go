package fleet

import (
	"context"
	"fmt"
	"slices"
	"strings"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/protobuf/proto"
)

// Attestation is AttestationService at fleet level. Verdicts are the VM's
// node's; image policies are fleet-wide: an import, a clear and golden
// values recorded from a VM apply on every node, so a VM attests alike
// wherever it is placed.
type Attestation struct {
	// Unsafe, not Unimplemented: see Hypervisor.
	attestationv1.UnsafeAttestationServiceServer
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
// lowest-index node's copy of each. A node that does not answer is a
// warning, and so is a policy that is not the same on every node that
// answered (missing, or another document or golden values): fleet-wide
// policies that drifted apart are said, not hidden.
func (a *Attestation) ListImagePolicies(ctx context.Context, req *attestationv1.ListImagePoliciesRequest) (*attestationv1.ListImagePoliciesResponse, error) {
	out := &attestationv1.ListImagePoliciesResponse{}
	first := map[string]*attestationv1.ImagePolicy{}
	var answered []*node
	held := map[string]map[string]bool{} // image -> nodes holding first's version
	for _, x := range fanOut(ctx, a.r, func(ctx context.Context, n *node) (*attestationv1.ListImagePoliciesResponse, error) {
		return n.at.ListImagePolicies(ctx, req)
	}) {
		if x.err != nil {
			out.Warnings = append(out.Warnings, warning(x.node, x.err))
			continue
		}
		answered = append(answered, x.node)
		for _, p := range x.val.GetPolicies() {
			f := first[p.GetImage()]
			if f == nil {
				f = p
				first[p.GetImage()] = p
				held[p.GetImage()] = map[string]bool{}
				out.Policies = append(out.Policies, p)
			}
			if samePolicy(f, p) {
				held[p.GetImage()][x.node.Name] = true
			}
		}
	}
	for _, p := range out.Policies {
		var differ []string
		for _, n := range answered {
			if !held[p.GetImage()][n.Name] {
				differ = append(differ, n.Name)
			}
		}
		if len(differ) > 0 {
			out.Warnings = append(out.Warnings, fmt.Sprintf("policy %s is missing or different on %s (import it again through the fleet)", p.GetImage(), strings.Join(differ, ", ")))
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

// samePolicy is whether two nodes hold the same policy: the same document
// (golden values included) and golden PCRs. Not source_sha256: golden
// values recorded on one node reach the others as a new import.
func samePolicy(a, b *attestationv1.ImagePolicy) bool {
	return slices.Equal(a.GetGoldenPcrs(), b.GetGoldenPcrs()) && proto.Equal(a.GetDocument(), b.GetDocument())
}
