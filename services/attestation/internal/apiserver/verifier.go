package apiserver

import (
	"context"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verifier"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// IssueNonce hands out a single-use nonce bound to the VM's current boot. It
// is kept in memory and nothing is written: a guest asks as often as it likes.
func (s *Server) IssueNonce(_ context.Context, req *attestationv1.IssueNonceRequest) (*attestationv1.IssueNonceResponse, error) {
	s.forget.RLock()
	defer s.forget.RUnlock()
	vm, att, err := s.store.GetVM(req.GetVmId())
	if err != nil {
		return nil, err
	}
	n, expires, err := s.nonces.Issue(vm.ID, att.GetBoot())
	if err != nil {
		return nil, err
	}
	return &attestationv1.IssueNonceResponse{Nonce: n, ExpireTime: timestamppb.New(expires), Boot: att.GetBoot()}, nil
}

// ErrNonceLost is verifier.ErrNonceLost: a quote on a nonce an earlier run
// issued is answered unavailable, so vm-agent retries with a new one.
var ErrNonceLost = verifier.ErrNonceLost

// VerifyQuote judges a quote (internal/verifier). A rejection is a verdict
// (recorded, returned), not an error.
func (s *Server) VerifyQuote(_ context.Context, req *attestationv1.VerifyQuoteRequest) (*attestationv1.VerifyQuoteResponse, error) {
	v, err := s.verifier.Verify(verifier.Submission{VMID: req.GetVmId(), Nonce: req.GetNonce(), Quote: verify.Quote{
		Stage: req.GetStage(), AKPub: req.GetAkPub(), Attest: req.GetQuote(), Signature: req.GetSignature(), PCRs: req.GetPcrs(),
		EventLog: req.GetEventLog(), UserspaceLog: req.GetUserspaceLog(),
	}})
	if err != nil {
		return nil, err
	}
	return &attestationv1.VerifyQuoteResponse{
		Stage: v.Stage, Verified: v.Quote.GetVerified(), UserDataReleased: v.UserDataReleased,
		Message: v.Quote.GetMessage(), Attestation: v.Attestation,
	}, nil
}

// RecordGolden copies a VM's verified ready-stage PCRs into its image's
// golden values (internal/verifier), recording the caller.
func (s *Server) RecordGolden(ctx context.Context, req *attestationv1.RecordGoldenRequest) (*attestationv1.ImagePolicy, error) {
	if err := checkImage(req.GetImage()); err != nil {
		return nil, err
	}
	return s.verifier.RecordGolden(req.GetImage(), req.GetFromVm(), identity.FromContext(ctx).String())
}
