package apiserver

import (
	"cmp"
	"context"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/gate"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/nonce"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policy"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
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

// ErrNonceLost answers a quote on a nonce an earlier run of the service
// issued: unavailable, so vm-agent retries with a new nonce (a 403 verdict
// would be final, and the user-data of a VM that requires attestation would
// stay gated). Nothing is recorded.
var ErrNonceLost = apierr.Errorf(apierr.Unavailable, "the nonce was issued before attestation restarted and is gone with it: fetch a new one")

// noteNonce sets nonceIssuedAt from the nonces this run issued for the boot.
func (s *Server) noteNonce(vmID string, att *attestationv1.Attestation) {
	if at, ok := s.nonces.LastIssued(vmID, att.GetBoot()); ok && (att.GetNonceIssuedAt() == nil || at.After(att.GetNonceIssuedAt().AsTime())) {
		att.NonceIssuedAt = timestamppb.New(at)
	}
}

// VerifyQuote runs the contract's verification steps in order; the first
// failure rejects. A rejection is a verdict (recorded, returned), not an error.
func (s *Server) VerifyQuote(_ context.Context, req *attestationv1.VerifyQuoteRequest) (*attestationv1.VerifyQuoteResponse, error) {
	stage := req.GetStage()
	if stage != attestationv1.Stage_STAGE_INITRD && stage != attestationv1.Stage_STAGE_READY {
		return nil, apierr.Invalidf("stage", "stage must be initrd or ready")
	}
	defer s.vms.lock(req.GetVmId())()
	// After the VM's lock: a caller queued behind another verdict of its VM
	// cannot write before that commit, so a commit must not wait for it.
	// Done when the verdict is handed to the store, so the commit after it
	// does not wait for a write already made.
	announced := s.store.Announce()
	defer announced()
	vm, att, err := s.store.GetVM(req.GetVmId())
	if err != nil {
		return nil, err
	}
	record := func(q *attestationv1.Quote) (*attestationv1.VerifyQuoteResponse, error) {
		announced()
		return s.record(vm, att, stage, q)
	}
	now := s.now()
	verdict := &attestationv1.Quote{At: timestamppb.New(now), Pcrs: hexPCRs(req.GetPcrs())}
	reject := func(reason string) (*attestationv1.VerifyQuoteResponse, error) {
		verdict.Message = reason
		return record(verdict)
	}

	// 1. The nonce: issued to this VM for this boot, unexpired, unused. Any
	// attempt uses it up.
	switch s.nonces.Consume(vm.ID, att.GetBoot(), req.GetNonce()) {
	case nonce.Lost:
		s.log.Info("quote on a nonce lost in a restart of attestation: the guest is told to fetch a new one", "vm", vm.ID, "stage", stage.String())
		return nil, ErrNonceLost
	case nonce.Unknown:
		return reject("unknown or expired nonce")
	}
	if s.opts.Mode == attestationv1.Mode_MODE_NOOP {
		verdict.Verified = true
		verdict.Message = "accepted without verification (--attestation=noop)"
		return record(verdict)
	}
	// 3. The image's policy. Learn mode judges an image without one as if
	// its policy were empty: every golden PCR is learned.
	pol, err := s.store.SharedPolicy(vm.Image) // read only
	if apierr.CodeOf(err) == apierr.NotFound && s.opts.LearnGolden {
		pol, err = &attestationv1.ImagePolicy{}, nil
	}
	if apierr.CodeOf(err) == apierr.NotFound {
		return reject(fmt.Sprintf("no policy for image %s: import its policy.json", vm.Image))
	}
	if err != nil {
		return nil, err
	}
	// 4–10. Parse, key, signature, nonce, bank, PCR digest, coverage.
	res, err := verify.Check(verify.Quote{
		Stage: stage, AKPub: req.GetAkPub(), Attest: req.GetQuote(), Signature: req.GetSignature(),
		PCRs: req.GetPcrs(), EventLog: req.GetEventLog(), UserspaceLog: req.GetUserspaceLog(),
		Key: s.aks.key(vm),
	}, req.GetNonce())
	if err != nil {
		return reject(err.Error())
	}
	verdict.AkFingerprint = res.AKFingerprint
	verdict.Pcrs = hexPCRs(res.PCRs)
	if res.EventLogError != "" {
		// Not a rejection; the operator's only clue why no event is named.
		s.log.Info("event log not used", "vm", vm.ID, "stage", stage.String(), "reason", res.EventLogError)
	}
	// 11. The VM's key: the one the hypervisor read from its vTPM and
	// registered before the boot. A key the guest brings counts for nothing,
	// however its public area describes itself.
	switch {
	case vm.AKFingerprint == "":
		return reject(fmt.Sprintf("ak %s is not the vTPM key of vm %s: no key is registered for it (the hypervisor registers the key it provisions in the vm's vTPM when the vm boots)", short(res.AKFingerprint), vm.ID))
	case vm.AKFingerprint != res.AKFingerprint && vm.AKOrigin == policystore.OriginFirstUse:
		return reject(fmt.Sprintf("ak %s is not the vTPM key of vm %s (pinned on first use: %s)", short(res.AKFingerprint), vm.ID, short(vm.AKFingerprint)))
	case vm.AKFingerprint != res.AKFingerprint:
		return reject(fmt.Sprintf("ak %s is not the vTPM key of vm %s (the host registered %s)", short(res.AKFingerprint), vm.ID, short(vm.AKFingerprint)))
	}
	// The firmware, by identity: its PCR 0 depends on the VM's memory and
	// vCPUs, so the build is what golden values are tied to.
	if reason := firmwareMismatch(pol.GetDocument(), vm.Firmware); reason != "" {
		return reject(reason)
	}
	// 12–13. PCR 11 and the golden values.
	var replayed []verify.Event
	if res.EventLogError == "" {
		replayed = res.Events // events are named only from logs that replay whole
	}
	out := policy.Evaluate(pol.GetDocument(), stage, vm.KubernetesVersion, vm.DirectKernel, vm.KernelCmdlineExtra, res.PCRs, replayed, s.opts.LearnGolden)
	if out.Reason != "" {
		// PCR 11 and 13 events are named from the policy, the others from
		// the stored golden boot. No mismatched golden value (a PCR 11
		// rejection) compares none: nil would compare every PCR.
		var fromGolden []*attestationv1.EventMismatch
		if len(out.Mismatched) > 0 {
			fromGolden = verify.Mismatches(s.goldenEvents(vm.Image), res.Events, out.Mismatched)
		}
		verdict.MismatchedEvents = slices.Concat(fromGolden, out.MismatchedEvents)
		slices.SortStableFunc(verdict.MismatchedEvents, func(a, b *attestationv1.EventMismatch) int { return cmp.Compare(a.GetPcr(), b.GetPcr()) })
		return reject(out.Reason)
	}
	verdict.Learned = out.Learned
	verdict.LearnMode = s.opts.LearnGolden
	if stage == attestationv1.Stage_STAGE_READY {
		vm.ReadyEvents = res.Events
	}
	// 15. The success message.
	msg := "verified: ak " + short(res.AKFingerprint)
	if verdict.LearnMode {
		msg = "verified in learn mode: ak " + short(res.AKFingerprint)
	}
	if out.Summary != "" {
		msg += ", " + out.Summary
	}
	if len(out.Learned) > 0 {
		var l []string
		for _, i := range out.Learned {
			l = append(l, fmt.Sprintf("%d=%x", i, res.PCRs[i]))
		}
		msg += "; accepted without golden value: " + strings.Join(l, " ")
		s.log.Warn("learn mode accepted PCRs without a golden value", "vm", vm.ID, "stage", stage.String(), "pcrs", out.Learned)
	}
	verdict.Verified = true
	verdict.Message = msg
	return record(verdict)
}

// record stores a verdict on the VM's current boot and answers with it. A
// rejection does not replace a verified verdict of the same boot and stage:
// anything in the guest can post a bad quote, and the boot's trust was
// established by the first good one. It is logged all the same.
func (s *Server) record(vm *policystore.VM, att *attestationv1.Attestation, stage attestationv1.Stage, q *attestationv1.Quote) (*attestationv1.VerifyQuoteResponse, error) {
	released := false
	slot := &att.Ready
	if stage == attestationv1.Stage_STAGE_INITRD {
		slot = &att.Initrd
	}
	if gate.Releases(att, stage, q.GetVerified()) {
		att.UserDataReleased, released = true, true
	}
	if q.GetVerified() || !(*slot).GetVerified() {
		*slot = q
	}
	s.noteNonce(vm.ID, att)
	if err := s.store.PutVM(vm, att); err != nil {
		return nil, err
	}
	s.log.Info("attestation verdict", "vm", vm.ID, "stage", stage.String(), "verified", q.GetVerified(), "message", q.GetMessage())
	return &attestationv1.VerifyQuoteResponse{
		Stage: stage, Verified: q.GetVerified(), UserDataReleased: released || att.GetUserDataReleased(),
		Message: q.GetMessage(), Attestation: att,
	}, nil
}

// RecordGolden copies a VM's verified ready-stage PCRs into its image's
// golden values, keeping every other field of the policy.
func (s *Server) RecordGolden(ctx context.Context, req *attestationv1.RecordGoldenRequest) (*attestationv1.ImagePolicy, error) {
	if err := checkImage(req.GetImage()); err != nil {
		return nil, err
	}
	vm, att, err := s.store.GetVM(req.GetFromVm())
	if err != nil {
		return nil, err
	}
	if vm.Image != req.GetImage() {
		return nil, apierr.Invalidf("from_vm", "vm %s runs image %s, not %s", vm.ID, vm.Image, req.GetImage())
	}
	ready := att.GetReady()
	if !ready.GetVerified() {
		return nil, apierr.Errorf(apierr.Conflict, "vm %s has no verified ready-stage quote in its current boot", vm.ID)
	}
	values := map[string]any{}
	for _, idx := range policy.GoldenPCRsFor(attestationv1.Stage_STAGE_READY, vm.DirectKernel) {
		v, ok := ready.GetPcrs()[idx]
		if !ok {
			return nil, apierr.Errorf(apierr.Conflict, "the ready quote of vm %s lacks pcr %d", vm.ID, idx)
		}
		values[strconv.Itoa(int(idx))] = v
	}
	if v, ok := ready.GetPcrs()[9]; ok {
		values["9"] = v // vm-agent quotes it on any image: pinned when there
	}
	golden, err := structpb.NewValue(map[string]any{"sha256": values})
	if err != nil {
		return nil, err
	}
	p, err := s.store.UpdatePolicy(req.GetImage(), func(old *attestationv1.ImagePolicy) (*attestationv1.ImagePolicy, error) {
		if old == nil {
			// An image without a policy (a learn-mode bring-up): the
			// golden values make one.
			cut := strings.LastIndex(req.GetImage(), "_") // versions have no "_"
			id, ver := req.GetImage()[:cut], req.GetImage()[cut+1:]
			old = &attestationv1.ImagePolicy{Image: req.GetImage(), ImportTime: timestamppb.New(s.now()), Document: &structpb.Struct{Fields: map[string]*structpb.Value{
				"image_id": structpb.NewStringValue(id), "image_version": structpb.NewStringValue(ver),
			}}}
		}
		p := proto.Clone(old).(*attestationv1.ImagePolicy)
		if p.Document == nil {
			p.Document = &structpb.Struct{}
		}
		if p.Document.Fields == nil {
			p.Document.Fields = map[string]*structpb.Value{}
		}
		p.Document.Fields["golden"] = golden
		delete(p.Document.Fields, "golden_firmware")
		if fw := vm.Firmware; fw != nil {
			m := map[string]any{"sha256": fw.SHA256}
			if fw.Package != "" {
				m["package"], m["version"] = fw.Package, fw.Version
			}
			v, err := structpb.NewValue(m)
			if err != nil {
				return nil, err
			}
			p.Document.Fields["golden_firmware"] = v
		}
		p.GoldenPcrs = policy.GoldenPCRs(p.Document)
		p.GoldenFromVm = vm.ID
		p.GoldenUpdatedBy = identity.FromContext(ctx).String()
		p.GoldenUpdateTime = timestamppb.New(s.now())
		return p, nil
	})
	if err != nil {
		return nil, err
	}
	if err := s.store.PutGoldenEvents(req.GetImage(), vm.ReadyEvents); err != nil {
		return nil, err
	}
	s.log.Info("golden values recorded", "image", req.GetImage(), "vm", vm.ID, "pcrs", slices.Sorted(maps.Keys(values)))
	return p, nil
}

func (s *Server) goldenEvents(image string) []verify.Event {
	ev, _ := s.store.GoldenEvents(image)
	return ev
}

// firmwareMismatch refuses a VM that boots another firmware build than the
// one the image's golden values were recorded on (golden_firmware.sha256),
// when both are known.
func firmwareMismatch(doc *structpb.Struct, running *policystore.Firmware) string {
	golden := doc.GetFields()["golden_firmware"].GetStructValue().GetFields()
	want := golden["sha256"].GetStringValue()
	if want == "" || running == nil || running.SHA256 == "" || strings.EqualFold(want, running.SHA256) {
		return ""
	}
	return fmt.Sprintf("firmware mismatch: the golden values were recorded on firmware %s, this vm boots %s",
		firmwareName(golden["package"].GetStringValue(), golden["version"].GetStringValue(), want),
		firmwareName(running.Package, running.Version, running.SHA256))
}

func firmwareName(pkg, ver, sum string) string {
	if pkg == "" {
		return "sha256 " + short(sum)
	}
	return fmt.Sprintf("%s %s (sha256 %s)", pkg, ver, short(sum))
}

func hexPCRs(in map[uint32][]byte) map[uint32]string {
	out := make(map[uint32]string, len(in))
	for k, v := range in {
		out[k] = hex.EncodeToString(v)
	}
	return out
}

func short(fp string) string {
	if len(fp) > 16 {
		return fp[:16]
	}
	return fp
}
