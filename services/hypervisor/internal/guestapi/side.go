// Package guestapi is what a guest reaches through the IMDS: nonces and quotes
// (relayed to the attestation service, which decides), user-data behind the
// attestation gate, its keys, its report uploads and the image's sysupdate
// files. The VM records it reads and updates are the VM manager's.
package guestapi

import (
	"context"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"sync"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Records are the VM records the guest side reads and changes.
type Records interface {
	// Record returns a copy of one VM's record (not_found when there is none).
	Record(id string) (*storepb.VirtualMachine, error)
	// Records returns copies of every record, oldest first.
	Records() []*storepb.VirtualMachine
	// Leased calls fn with the record of the VM holding the lease on ip in
	// network, under that record's lock, and says whether there is one. The
	// IMDS looks its caller up on every request: nothing is copied but what
	// fn takes, and fn must neither keep nor change the record.
	Leased(network string, ip netip.Addr, fn func(*storepb.VirtualMachine)) bool
	// Update applies fn to a VM's record and persists it.
	Update(id string, fn func(*storepb.VirtualMachine)) error
	// PoolMemberWaiting says whether the VM is an unclaimed warm-pool
	// member, and records that its guest waits for its user-data.
	PoolMemberWaiting(id string) bool
}

// Boots say how a VM's current boot is registered with attestation (the key
// the host provisioned, the image, the firmware): vm.Boots.
type Boots interface {
	BeginBootRequest(rec *storepb.VirtualMachine) *attestationv1.BeginBootRequest
}

// Config is the guest side's settings.
type Config struct {
	// ImageDir is the catalog, whose sysupdate/ tree guests may fetch.
	ImageDir string
	// SeriesLimit bounds the exported series of one guest's report
	// (--metrics-guest-series-limit; DefaultGuestSeriesLimit when 0).
	SeriesLimit int
}

// Side serves the guests of every network.
type Side struct {
	records  Records
	boots    Boots
	verifier attestationv1.VerifierServiceClient
	cfg      Config
	log      *slog.Logger

	// lateBoots serialises beginLate, so that concurrent nonce requests of
	// one boot begin it once.
	lateBoots sync.Mutex

	mu      sync.Mutex
	reports map[string]*reportState // by VM id
}

// New returns the guest side over the VM records; verifier nil answers
// every attestation request as unavailable.
func New(records Records, boots Boots, verifier attestationv1.VerifierServiceClient, cfg Config, log *slog.Logger) *Side {
	if cfg.SeriesLimit <= 0 {
		cfg.SeriesLimit = DefaultGuestSeriesLimit
	}
	return &Side{records: records, boots: boots, verifier: verifier, cfg: cfg, log: log, reports: map[string]*reportState{}}
}

// Network is the IMDS's view of one network: addresses may repeat across
// networks, so a caller is looked up among that network's VMs only.
func (s *Side) Network(name string) *NetworkView { return &NetworkView{Side: s, network: name} }

// NetworkView is what one network's IMDS serves from.
type NetworkView struct {
	*Side
	network string
}

// ByIP finds the VM holding a lease on ip in this network; VMs being
// deleted are excluded.
func (n *NetworkView) ByIP(ip netip.Addr) (*hypervisorv1.VirtualMachine, bool) {
	var vm *hypervisorv1.VirtualMachine
	n.records.Leased(n.network, ip.Unmap(), func(rec *storepb.VirtualMachine) {
		if rec.GetState() != hypervisorv1.State_STATE_DELETING {
			vm = publicView(rec)
		}
	})
	return vm, vm != nil
}

// publicView is what the IMDS reads of a record: the fields it serves. The
// metadata map is shared, not copied: it is set at create and nothing
// changes it in place afterwards.
func publicView(rec *storepb.VirtualMachine) *hypervisorv1.VirtualMachine {
	return &hypervisorv1.VirtualMachine{
		Id: rec.GetId(), Name: rec.GetName(), Hostname: rec.GetHostname(), Region: rec.GetRegion(), Zone: rec.GetZone(),
		KubernetesVersion: rec.GetKubernetesVersion(), Metadata: rec.GetMetadata(), Network: rec.GetNetwork(), Ip: rec.GetIp(),
		State: rec.GetState(), Phase: rec.GetPhase(),
	}
}

// IssueNonce asks attestation for a nonce; the first one of a boot moves a VM
// that requires attestation from booting to attesting.
func (s *Side) IssueNonce(ctx context.Context, vmID string) ([]byte, error) {
	rec, err := s.records.Record(vmID)
	if err != nil {
		return nil, err
	}
	if s.verifier == nil {
		return nil, apierr.Errorf(apierr.Unavailable, "no attestation service")
	}
	if err := s.beginLate(ctx, rec); err != nil {
		return nil, err
	}
	resp, err := s.verifier.IssueNonce(ctx, &attestationv1.IssueNonceRequest{VmId: vmID})
	if err != nil {
		return nil, err
	}
	// The record is written for the boot's first nonce only: a guest asks
	// as often as it likes, and each write is an fsync in the database every
	// VM's record is in. Later nonces' time comes with the next verdict.
	if rec, err = s.records.Record(vmID); err != nil {
		return nil, err
	}
	if rec.GetAttestation().GetNonceIssuedAt() != nil &&
		!(rec.GetRequireAttestation() && rec.GetState() == hypervisorv1.State_STATE_BOOTING) {
		return resp.GetNonce(), nil
	}
	err = s.records.Update(vmID, func(r *storepb.VirtualMachine) {
		if r.Attestation == nil {
			r.Attestation = &attestationv1.Attestation{}
		}
		r.Attestation.NonceIssuedAt = timestamppb.Now()
		if r.GetRequireAttestation() && r.GetState() == hypervisorv1.State_STATE_BOOTING {
			r.State = hypervisorv1.State_STATE_ATTESTING
		}
	})
	if err != nil {
		return nil, err
	}
	return resp.GetNonce(), nil
}

// beginLate begins the VM's current boot in attestation when its launch
// could not (attestation was down then; the record's attestation has no boot
// number). Without it attestation refuses the boot's nonces (a VM it has
// never seen: the guest retried until the boot timeout, found by the fault
// suite) or takes the guest's quotes as the previous boot's, whose verified
// verdict a rejected quote does not erase.
func (s *Side) beginLate(ctx context.Context, rec *storepb.VirtualMachine) error {
	if rec.GetAttestation().GetBoot() != 0 || rec.GetPhase() != hypervisorv1.Phase_PHASE_BOOT {
		return nil
	}
	s.lateBoots.Lock()
	defer s.lateBoots.Unlock()
	rec, err := s.records.Record(rec.GetId())
	if err != nil {
		return err
	}
	if rec.GetAttestation().GetBoot() != 0 {
		return nil
	}
	att, err := s.verifier.BeginBoot(ctx, s.boots.BeginBootRequest(rec))
	if err != nil {
		return err
	}
	s.log.Info("attestation recorded the boot at the guest's first nonce (it was unavailable at launch)", "vm", rec.GetId(), "boot", att.GetBoot())
	return s.records.Update(rec.GetId(), func(r *storepb.VirtualMachine) {
		if r.GetAttestation().GetBoot() == 0 {
			r.Attestation = att
		}
	})
}

// RejectedPrefix marks a lastError written by a rejected initrd quote, which
// a verified retry clears (and READY=1 keeps).
const RejectedPrefix = "initrd attestation rejected: "

// SubmitQuote relays a quote to attestation and copies the verdict onto the
// VM record; a verified initrd quote opens the user-data gate.
func (s *Side) SubmitQuote(ctx context.Context, vmID string, q *attestationv1.VerifyQuoteRequest) (*attestationv1.VerifyQuoteResponse, error) {
	if _, err := s.records.Record(vmID); err != nil {
		return nil, err
	}
	if s.verifier == nil {
		return nil, apierr.Errorf(apierr.Unavailable, "no attestation service")
	}
	q.VmId = vmID
	resp, err := s.verifier.VerifyQuote(ctx, q)
	if err != nil {
		return nil, err
	}
	if resp.GetVerified() {
		s.keepVerifiedLogs(vmID, q)
	}
	err = s.records.Update(vmID, func(r *storepb.VirtualMachine) {
		r.Attestation = resp.GetAttestation() // the cache takes attestation's verdict as it is
		if q.GetStage() != attestationv1.Stage_STAGE_INITRD {
			return
		}
		switch {
		case !resp.GetVerified():
			r.LastError = RejectedPrefix + resp.GetMessage()
		case strings.HasPrefix(r.GetLastError(), RejectedPrefix):
			r.LastError = ""
		}
	})
	if err != nil {
		return nil, err
	}
	return resp, nil
}

// AwaitingClaim says whether the VM is a warm pool's member that no create
// has claimed yet: its user-data is the claimer's, and is not there yet.
func (s *Side) AwaitingClaim(vmID string) bool { return s.records.PoolMemberWaiting(vmID) }

// UserData returns the VM's user-data, whether it has any, and whether the
// attestation gate is open.
func (s *Side) UserData(vmID string) ([]byte, bool, bool, error) {
	rec, err := s.records.Record(vmID)
	if err != nil {
		return nil, false, false, err
	}
	path := rec.GetPaths().GetUserData()
	if path == "" {
		return nil, false, false, nil
	}
	// The gate as attestation last decided it (the record's cached verdict,
	// written from its answers only): no rule is evaluated here.
	if !rec.GetAttestation().GetUserDataReleased() {
		return nil, true, false, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, true, true, err
	}
	return b, true, true, nil
}

// SSHKeys are the keys served at public-keys/: vm-manager's per-VM key first
// (once the VM has one), then the caller's.
func (s *Side) SSHKeys(vmID string) []string {
	rec, err := s.records.Record(vmID)
	if err != nil {
		return nil
	}
	var keys []string
	if k := rec.GetSshPublicKey(); k != "" {
		keys = append(keys, k)
	}
	return append(keys, rec.GetSshAuthorizedKeys()...)
}
