// Package apiserver implements the public AttestationService and the
// pod-internal VerifierService over the policy store. Quotes and golden
// values are judged and recorded by internal/verifier; the handlers check
// requests and translate.
package apiserver

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"log/slog"
	"regexp"
	"sync"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/pkg/gate"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/nonce"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policy"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verifier"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Options are how quotes are judged.
type Options struct {
	Mode        attestationv1.Mode
	LearnGolden bool
	// Log receives verdicts and learn-mode warnings; nil discards them.
	Log *slog.Logger
	// MaxNonces bounds the outstanding nonces of all VMs together; 0 is
	// nonce.DefaultMax.
	MaxNonces int
}

// Server implements both services.
type Server struct {
	// Unsafe, not Unimplemented: an RPC without a handler does not compile.
	attestationv1.UnsafeAttestationServiceServer
	attestationv1.UnsafeVerifierServiceServer
	store    *policystore.Store
	nonces   *nonce.Store
	verifier *verifier.Verifier // over store and nonces
	// forget keeps a nonce from being issued to a VM being forgotten (its
	// entry in nonces would outlive it): IssueNonce holds it shared.
	forget sync.RWMutex
	vms    *vmLocks
	aks    *akCache
	opts   Options
	log    *slog.Logger
	now    func() time.Time
}

// New returns the services over a store, with no nonce outstanding.
func New(st *policystore.Store, opts Options) (*Server, error) {
	log := opts.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{store: st, vms: newVMLocks(), aks: newAKCache(), opts: opts, log: log, now: time.Now}
	if err := s.resetNonces(); err != nil {
		return nil, err
	}
	return s, nil
}

// resetNonces starts an empty nonce store on s.now, as a restart does, and
// the verifier over it.
func (s *Server) resetNonces() error {
	key, err := s.store.NonceKey()
	if err != nil {
		return err
	}
	now := func() time.Time { return s.now() } // s.now as it is at each call
	if s.nonces, err = nonce.New(nonce.Options{Key: key, Max: s.opts.MaxNonces, Now: now}); err != nil {
		return err
	}
	s.verifier = verifier.New(s.store, s.store, s.nonces, s.vms, verifier.Options{
		Mode: s.opts.Mode, LearnGolden: s.opts.LearnGolden, Log: s.log, Keys: s.aks, Now: now,
	})
	return nil
}

var (
	vmID     = regexp.MustCompile(`^[0-9a-f]{8}$`)
	imageRef = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._+-]*_[A-Za-z0-9.+-]+$`)
)

func checkImage(ref string) error {
	if !imageRef.MatchString(ref) {
		return apierr.Invalidf("image", "image %q is not <id>_<version>", ref)
	}
	return nil
}

// short is a fingerprint as log lines name it.
func short(fp string) string {
	if len(fp) > 16 {
		return fp[:16]
	}
	return fp
}

// Warnings are what an operator must know about the mode.
func (o Options) Warnings() []string {
	var w []string
	if o.Mode == attestationv1.Mode_MODE_NOOP {
		w = append(w, "attestation=noop: every quote with a valid nonce is accepted and releases user-data; nothing is verified")
	}
	if o.LearnGolden {
		w = append(w, "learn mode: PCRs without a golden value are accepted and reported as learned; record golden values and turn it off")
	}
	return w
}

func (s *Server) GetAttestationStatus(context.Context, *attestationv1.GetAttestationStatusRequest) (*attestationv1.AttestationStatus, error) {
	n, err := s.store.PolicyCount()
	if err != nil {
		return nil, err
	}
	ns := s.nonces.Stats()
	return &attestationv1.AttestationStatus{Mode: s.opts.Mode, LearnGolden: s.opts.LearnGolden, Warnings: s.opts.Warnings(), PolicyCount: uint32(n),
		Nonces: &attestationv1.NonceStats{
			Outstanding: uint32(ns.Outstanding), Limit: uint32(ns.Max), Issued: ns.Issued, Expired: ns.Expired,
			DroppedPerVm: ns.DroppedPerVM, DroppedAtLimit: ns.DroppedAtMax, LostInRestart: ns.Lost,
		}}, nil
}

func (s *Server) ListImagePolicies(context.Context, *attestationv1.ListImagePoliciesRequest) (*attestationv1.ListImagePoliciesResponse, error) {
	ps, err := s.store.ListPolicies()
	if err != nil {
		return nil, err
	}
	return &attestationv1.ListImagePoliciesResponse{Policies: ps}, nil
}

func (s *Server) GetImagePolicy(_ context.Context, req *attestationv1.GetImagePolicyRequest) (*attestationv1.ImagePolicy, error) {
	if err := checkImage(req.GetImage()); err != nil {
		return nil, err
	}
	return s.store.GetPolicy(req.GetImage())
}

// ImportImagePolicy stores a policy.json. Golden values recorded (or cleared)
// through the API since the last import survive an import whose document has
// no golden section of its own, so re-importing a catalog file does not undo
// RecordGolden.
func (s *Server) ImportImagePolicy(_ context.Context, req *attestationv1.ImportImagePolicyRequest) (*attestationv1.ImagePolicy, error) {
	return s.importPolicy(req.GetImage(), req.GetDocument())
}

// SyncImagePolicy is ImportImagePolicy for the hypervisor's image catalog,
// on the pod-internal VerifierService.
func (s *Server) SyncImagePolicy(_ context.Context, req *attestationv1.SyncImagePolicyRequest) (*attestationv1.ImagePolicy, error) {
	return s.importPolicy(req.GetImage(), req.GetDocument())
}

func (s *Server) importPolicy(image string, doc *structpb.Struct) (*attestationv1.ImagePolicy, error) {
	if err := checkImage(image); err != nil {
		return nil, err
	}
	if err := policy.Validate(image, doc); err != nil {
		return nil, err
	}
	// encoding/json sorts map keys, so the digest is stable across builds
	// (protojson's output deliberately is not).
	raw, err := json.Marshal(doc.AsMap())
	if err != nil {
		return nil, apierr.Invalidf("document", "policy document: %v", err)
	}
	sum := sha256.Sum256(raw)
	return s.store.UpdatePolicy(image, func(old *attestationv1.ImagePolicy) (*attestationv1.ImagePolicy, error) {
		doc := proto.Clone(doc).(*structpb.Struct)
		p := &attestationv1.ImagePolicy{
			Image:        image,
			Document:     doc,
			SourceSha256: hex.EncodeToString(sum[:]),
			ImportTime:   timestamppb.New(s.now()),
		}
		if old != nil && old.GetGoldenUpdateTime() != nil {
			if _, own := doc.GetFields()["golden"]; !own {
				if doc.Fields == nil {
					doc.Fields = map[string]*structpb.Value{}
				}
				// Golden values and the firmware they were recorded on go together.
				for _, k := range []string{"golden", "golden_firmware"} {
					if v, ok := old.GetDocument().GetFields()[k]; ok {
						doc.Fields[k] = v
					} else {
						delete(doc.Fields, k)
					}
				}
				p.GoldenUpdateTime, p.GoldenFromVm, p.GoldenUpdatedBy = old.GoldenUpdateTime, old.GoldenFromVm, old.GoldenUpdatedBy
			}
		}
		p.GoldenPcrs = policy.GoldenPCRs(doc)
		if err := policy.Enforces(image, doc); err != nil {
			return nil, err
		}
		return p, nil
	})
}

// ClearGolden drops an image's golden values and records who did.
func (s *Server) ClearGolden(ctx context.Context, req *attestationv1.ClearGoldenRequest) (*attestationv1.ImagePolicy, error) {
	if err := checkImage(req.GetImage()); err != nil {
		return nil, err
	}
	return s.store.UpdatePolicy(req.GetImage(), func(old *attestationv1.ImagePolicy) (*attestationv1.ImagePolicy, error) {
		if old == nil {
			return nil, apierr.Errorf(apierr.NotFound, "no policy for image %q", req.GetImage())
		}
		delete(old.GetDocument().GetFields(), "golden")
		delete(old.GetDocument().GetFields(), "golden_firmware")
		old.GoldenPcrs = nil
		old.GoldenFromVm = ""
		old.GoldenUpdatedBy = identity.FromContext(ctx).String()
		old.GoldenUpdateTime = timestamppb.New(s.now())
		return old, nil
	})
}

func (s *Server) GetVirtualMachineAttestation(_ context.Context, req *attestationv1.GetVirtualMachineAttestationRequest) (*attestationv1.Attestation, error) {
	if !vmID.MatchString(req.GetId()) {
		return nil, apierr.Errorf(apierr.NotFound, "vm %q not found", req.GetId())
	}
	return s.verifier.Attestation(req.GetId())
}

// BeginBoot starts a new boot's verdicts and registers the attestation key
// the hypervisor read from the VM's vTPM: from then on only that key's quotes
// count. A request without a key (a VM launched before host provisioning)
// keeps the first-use pin the VM may have.
func (s *Server) BeginBoot(_ context.Context, req *attestationv1.BeginBootRequest) (*attestationv1.Attestation, error) {
	if !vmID.MatchString(req.GetVmId()) {
		return nil, apierr.Invalidf("vm_id", "vm id %q is not 8 hex characters", req.GetVmId())
	}
	if err := checkImage(req.GetImage()); err != nil {
		return nil, err
	}
	var ak *verify.AK
	if len(req.GetAkPublic()) > 0 {
		var err error
		if ak, err = verify.ParseAK(req.GetAkPublic()); err != nil {
			return nil, apierr.Invalidf("ak_public", "%v", err)
		}
	}
	defer s.vms.lock(req.GetVmId())()
	vm, att, err := s.store.GetVM(req.GetVmId())
	if apierr.CodeOf(err) == apierr.NotFound {
		vm, att, err = &policystore.VM{ID: req.GetVmId()}, &attestationv1.Attestation{}, nil
	}
	if err != nil {
		return nil, err
	}
	vm.Image, vm.KubernetesVersion, vm.DirectKernel = req.GetImage(), req.GetKubernetesVersion(), req.GetDirectKernel()
	vm.KernelCmdlineExtra = req.GetKernelCmdlineExtra()
	if fw := req.GetFirmware(); fw.GetSha256() != "" {
		vm.Firmware = &policystore.Firmware{SHA256: fw.GetSha256(), Package: fw.GetPackage(), Version: fw.GetVersion()}
	}
	if ak != nil {
		if vm.AKFingerprint != ak.Fingerprint() {
			s.log.Info("attestation key registered", "vm", vm.ID, "ak", short(ak.Fingerprint()), "replaces", short(vm.AKFingerprint), "replaced_origin", vm.AKOrigin)
		}
		vm.AKPub, vm.AKFingerprint, vm.AKOrigin, vm.EKPub = ak.Public(), ak.Fingerprint(), policystore.OriginHost, req.GetEkPublic()
	}
	next := gate.NewBoot(req.GetRequired())
	next.Boot = att.GetBoot() + 1
	if p := req.GetForkedFrom(); p != "" {
		if !vmID.MatchString(p) {
			return nil, apierr.Invalidf("forked_from", "vm id %q is not 8 hex characters", p)
		}
		next.ForkedFrom = p
		if pv, _, err := s.store.GetVM(p); err == nil {
			// A fork continues its parent's boot: its PCRs hold that boot's
			// chain, whatever the fork's own next cold boot would add.
			vm.DirectKernel, vm.KernelCmdlineExtra = pv.DirectKernel, pv.KernelCmdlineExtra
		}
		s.log.Info("boot registered as a fork", "vm", req.GetVmId(), "parent", p)
	}
	s.aks.forget(vm.ID)
	if err := s.store.PutVM(vm, next); err != nil {
		return nil, err
	}
	if ak != nil {
		s.aks.put(vm.ID, ak) // the boot's quotes need not parse it again
	}
	_, next, err = s.store.GetVM(vm.ID) // with the key's summary
	return next, err
}

func (s *Server) ForgetVirtualMachine(_ context.Context, req *attestationv1.ForgetVirtualMachineRequest) (*attestationv1.ForgetVirtualMachineResponse, error) {
	s.forget.Lock()
	defer s.forget.Unlock()
	defer s.vms.lock(req.GetVmId())()
	s.aks.forget(req.GetVmId())
	if err := s.store.DeleteVM(req.GetVmId()); err != nil {
		return nil, err
	}
	s.nonces.Forget(req.GetVmId())
	return &attestationv1.ForgetVirtualMachineResponse{}, nil
}
