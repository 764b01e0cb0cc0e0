// Package verifier judges a guest's quotes: the contract's verification
// steps (§5.4) for one quote in order, from the nonce to the verdict, the
// user-data gate (pkg/gate) and what is recorded on the VM's boot; and the
// golden values recorded from a verified boot, which later verdicts are
// judged against. The cryptography is internal/verify's, the policy's rules
// internal/policy's; this package runs them on a VM's state. It reaches that
// state, the nonces and the clock only through the interfaces below, so the
// gRPC handlers (internal/apiserver) only translate, and the rules are
// tested without bbolt.
package verifier

import (
	"cmp"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/gate"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/nonce"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policy"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// VMs are the VM records a verdict reads and writes (policystore.Store).
type VMs interface {
	GetVM(id string) (*policystore.VM, *attestationv1.Attestation, error)
	PutVM(vm *policystore.VM, att *attestationv1.Attestation) error
	// Announce says a PutVM is probably coming, so a group commit about to
	// start waits for it; done withdraws it.
	Announce() (done func())
}

// Policies are the images' policies and the golden boots' event logs
// (policystore.Store).
type Policies interface {
	// SharedPolicy's result is read only: it may be shared with other
	// callers.
	SharedPolicy(image string) (*attestationv1.ImagePolicy, error)
	UpdatePolicy(image string, fn func(old *attestationv1.ImagePolicy) (*attestationv1.ImagePolicy, error)) (*attestationv1.ImagePolicy, error)
	GoldenEvents(image string) ([]verify.Event, error)
	PutGoldenEvents(image string, events []verify.Event) error
}

// Nonces are the outstanding nonces (nonce.Store).
type Nonces interface {
	Consume(vm string, boot uint64, nonce []byte) nonce.Result
	LastIssued(vm string, boot uint64) (time.Time, bool)
}

// Locks serialize the read-modify-write of one VM's record with its other
// writers (a new boot, forgetting the VM): with group commit a write waits
// for the commit in progress, and two writers that read in that window
// would each drop the other's change.
type Locks interface {
	Lock(vmID string) (unlock func())
}

// Keys hand out VMs' registered AKs already parsed: nil when there is none
// (verify.Check then parses the quote's key and says what is wrong with it).
type Keys interface {
	Key(vm *policystore.VM) *verify.AK
}

// Options are how quotes are judged, and the optional ports.
type Options struct {
	Mode        attestationv1.Mode
	LearnGolden bool
	// Log receives verdicts and learn-mode warnings; nil discards them.
	Log *slog.Logger
	// Keys, when set, saves parsing a VM's key per quote.
	Keys Keys
	// Now is the clock verdicts and golden values are stamped with; nil is
	// time.Now.
	Now func() time.Time
}

// Verifier judges quotes and records golden values.
type Verifier struct {
	vms      VMs
	policies Policies
	nonces   Nonces
	locks    Locks
	opts     Options
	log      *slog.Logger
	now      func() time.Time
}

// New returns a Verifier over its ports.
func New(vms VMs, policies Policies, nonces Nonces, locks Locks, opts Options) *Verifier {
	v := &Verifier{vms: vms, policies: policies, nonces: nonces, locks: locks, opts: opts, log: opts.Log, now: opts.Now}
	if v.log == nil {
		v.log = slog.New(slog.DiscardHandler)
	}
	if v.now == nil {
		v.now = time.Now
	}
	return v
}

// ErrNonceLost answers a quote on a nonce an earlier run of the service
// issued: unavailable, so vm-agent retries with a new nonce (a 403 verdict
// would be final, and the user-data of a VM that requires attestation would
// stay gated). Nothing is recorded.
var ErrNonceLost = apierr.Errorf(apierr.Unavailable, "the nonce was issued before attestation restarted and is gone with it: fetch a new one")

// Submission is a quote as a guest posts it (contract §5.2), decoded: the
// VM, the nonce it answers, and the quote as verify.Check takes it (its Key
// is the verifier's to set).
type Submission struct {
	VMID  string
	Nonce []byte
	verify.Quote
}

// Verdict is a judged quote, as recorded.
type Verdict struct {
	Stage attestationv1.Stage
	// Quote is this quote's verdict. It is what the boot's slot for the
	// stage holds unless it is a rejection after a verified quote.
	Quote *attestationv1.Quote
	// UserDataReleased: the boot's gate is open (by this quote or before).
	UserDataReleased bool
	// Attestation is the VM's current boot after the verdict.
	Attestation *attestationv1.Attestation
}

// Verify runs the contract's verification steps in order; the first failure
// rejects. A rejection is a verdict (recorded, returned), not an error.
// Errors are a stage that is neither initrd nor ready, an unknown VM,
// ErrNonceLost and the store's.
func (v *Verifier) Verify(sub Submission) (*Verdict, error) {
	if sub.Stage != attestationv1.Stage_STAGE_INITRD && sub.Stage != attestationv1.Stage_STAGE_READY {
		return nil, apierr.Invalidf("stage", "stage must be initrd or ready")
	}
	defer v.locks.Lock(sub.VMID)()
	// After the VM's lock: a caller queued behind another verdict of its VM
	// cannot write before that commit, so a commit must not wait for it.
	// Done when the verdict is handed to the store, so the commit after it
	// does not wait for a write already made.
	announced := v.vms.Announce()
	defer announced()
	vm, att, err := v.vms.GetVM(sub.VMID)
	if err != nil {
		return nil, err
	}
	q, err := v.judge(vm, att, sub)
	if err != nil {
		return nil, err
	}
	announced()
	return v.record(vm, att, sub.Stage, q)
}

// judge returns the quote's verdict: verified, or rejected with the reason
// in Message. Errors are a lost nonce and the store's.
func (v *Verifier) judge(vm *policystore.VM, att *attestationv1.Attestation, sub Submission) (*attestationv1.Quote, error) {
	stage := sub.Stage
	verdict := &attestationv1.Quote{At: timestamppb.New(v.now()), Pcrs: hexPCRs(sub.PCRs)}
	reject := func(reason string) (*attestationv1.Quote, error) {
		verdict.Message = reason
		return verdict, nil
	}

	// 1. The nonce: issued to this VM for this boot, unexpired, unused. Any
	// attempt uses it up.
	switch v.nonces.Consume(vm.ID, att.GetBoot(), sub.Nonce) {
	case nonce.Lost:
		v.log.Info("quote on a nonce lost in a restart of attestation: the guest is told to fetch a new one", "vm", vm.ID, "stage", stage.String())
		return nil, ErrNonceLost
	case nonce.Unknown:
		return reject("unknown or expired nonce")
	}
	if v.opts.Mode == attestationv1.Mode_MODE_NOOP {
		verdict.Verified = true
		verdict.Message = "accepted without verification (--attestation=noop)"
		return verdict, nil
	}
	// 3. The image's policy. Learn mode judges an image without one as if
	// its policy were empty: every golden PCR is learned.
	pol, err := v.policies.SharedPolicy(vm.Image) // read only
	if apierr.CodeOf(err) == apierr.NotFound && v.opts.LearnGolden {
		pol, err = &attestationv1.ImagePolicy{}, nil
	}
	if apierr.CodeOf(err) == apierr.NotFound {
		return reject(fmt.Sprintf("no policy for image %s: import its policy.json", vm.Image))
	}
	if err != nil {
		return nil, err
	}
	// 4–10. Parse, key, signature, nonce, bank, PCR digest, coverage.
	var key *verify.AK
	if v.opts.Keys != nil {
		key = v.opts.Keys.Key(vm)
	}
	q := sub.Quote
	q.Key = key
	res, err := verify.Check(q, sub.Nonce)
	if err != nil {
		return reject(err.Error())
	}
	verdict.AkFingerprint = res.AKFingerprint
	verdict.Pcrs = hexPCRs(res.PCRs)
	if res.EventLogError != "" {
		// Not a rejection; the operator's only clue why no event is named.
		v.log.Info("event log not used", "vm", vm.ID, "stage", stage.String(), "reason", res.EventLogError)
	}
	// 11. The VM's key.
	if reason := keyMismatch(vm, res.AKFingerprint); reason != "" {
		return reject(reason)
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
	out := policy.Evaluate(pol.GetDocument(), stage, vm.KubernetesVersion, vm.DirectKernel, vm.KernelCmdlineExtra, res.PCRs, replayed, v.opts.LearnGolden)
	if out.Reason != "" {
		verdict.MismatchedEvents = v.mismatches(vm.Image, res.Events, out)
		return reject(out.Reason)
	}
	if stage == attestationv1.Stage_STAGE_READY {
		vm.ReadyEvents = res.Events // for RecordGolden
	}
	v.accept(vm.ID, stage, verdict, res, out)
	return verdict, nil
}

// accept marks verdict verified, with the success message (step 15), what
// learn mode accepted without a golden value and the OCI image verified.
func (v *Verifier) accept(vmID string, stage attestationv1.Stage, verdict *attestationv1.Quote, res *verify.Result, out policy.Outcome) {
	verdict.Learned = out.Learned
	verdict.LearnMode = v.opts.LearnGolden
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
		v.log.Warn("learn mode accepted PCRs without a golden value", "vm", vmID, "stage", stage.String(), "pcrs", out.Learned)
	}
	verdict.Verified = true
	verdict.Message = msg
	verdict.Oci = out.OCI // the OCI image whose root PCR 15 proved, if any
}

// keyMismatch says why a quote's key is not the VM's: the one the
// hypervisor read from its vTPM and registered before the boot. A key the
// guest brings counts for nothing, however its public area describes
// itself: there is no trust on first use.
func keyMismatch(vm *policystore.VM, fingerprint string) string {
	switch {
	case vm.AKFingerprint == "":
		return fmt.Sprintf("ak %s is not the vTPM key of vm %s: no key is registered for it (the hypervisor registers the key it provisions in the vm's vTPM when the vm boots)", short(fingerprint), vm.ID)
	case vm.AKFingerprint != fingerprint && vm.AKOrigin == policystore.OriginFirstUse:
		return fmt.Sprintf("ak %s is not the vTPM key of vm %s (pinned on first use: %s)", short(fingerprint), vm.ID, short(vm.AKFingerprint))
	case vm.AKFingerprint != fingerprint:
		return fmt.Sprintf("ak %s is not the vTPM key of vm %s (the host registered %s)", short(fingerprint), vm.ID, short(vm.AKFingerprint))
	}
	return ""
}

// mismatches are the events a rejection names, by PCR. PCR 11 and 13
// events are named from the policy (out), the others from the stored golden
// boot. No mismatched golden value (a PCR 11 rejection) compares none: nil
// would compare every PCR.
func (v *Verifier) mismatches(image string, events []verify.Event, out policy.Outcome) []*attestationv1.EventMismatch {
	var fromGolden []*attestationv1.EventMismatch
	if len(out.Mismatched) > 0 {
		golden, _ := v.policies.GoldenEvents(image) // without them, none is named
		fromGolden = verify.Mismatches(golden, events, out.Mismatched)
	}
	ms := slices.Concat(fromGolden, out.MismatchedEvents)
	slices.SortStableFunc(ms, func(a, b *attestationv1.EventMismatch) int { return cmp.Compare(a.GetPcr(), b.GetPcr()) })
	return ms
}

// record stores a verdict on the VM's current boot and answers with it. A
// rejection does not replace a verified verdict of the same boot and stage:
// anything in the guest can post a bad quote, and the boot's trust was
// established by the first good one. It is logged all the same.
func (v *Verifier) record(vm *policystore.VM, att *attestationv1.Attestation, stage attestationv1.Stage, q *attestationv1.Quote) (*Verdict, error) {
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
	v.noteNonce(vm.ID, att)
	if err := v.vms.PutVM(vm, att); err != nil {
		return nil, err
	}
	v.log.Info("attestation verdict", "vm", vm.ID, "stage", stage.String(), "verified", q.GetVerified(), "message", q.GetMessage())
	return &Verdict{Stage: stage, Quote: q, UserDataReleased: released || att.GetUserDataReleased(), Attestation: att}, nil
}

// Attestation returns a VM's current boot as recorded, with when this run
// last issued it a nonce.
func (v *Verifier) Attestation(vmID string) (*attestationv1.Attestation, error) {
	vm, att, err := v.vms.GetVM(vmID)
	if err != nil {
		return nil, err
	}
	v.noteNonce(vm.ID, att)
	return att, nil
}

// noteNonce sets nonceIssuedAt from the nonces this run issued for the boot:
// they are not stored, so the record's value may be older.
func (v *Verifier) noteNonce(vmID string, att *attestationv1.Attestation) {
	if at, ok := v.nonces.LastIssued(vmID, att.GetBoot()); ok && (att.GetNonceIssuedAt() == nil || at.After(att.GetNonceIssuedAt().AsTime())) {
		att.NonceIssuedAt = timestamppb.New(at)
	}
}
