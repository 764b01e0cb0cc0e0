package verifier

import (
	"fmt"
	"sync"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/attestation/internal/nonce"
	"github.com/giantswarm/vm-manager/services/attestation/internal/policystore"
	"github.com/giantswarm/vm-manager/services/attestation/internal/verify"
	"google.golang.org/protobuf/proto"
)

// fakeVMs keeps records as copies, as a store does, and checks the rules a
// write must follow: under the VM's lock, with the caller's announcement
// withdrawn.
type fakeVMs struct {
	t     *testing.T
	locks *fakeLocks
	recs  map[string]record
	puts  int
	// announced counts announcements not withdrawn.
	announced int
}

type record struct {
	vm  policystore.VM
	att *attestationv1.Attestation
}

func (f *fakeVMs) GetVM(id string) (*policystore.VM, *attestationv1.Attestation, error) {
	r, ok := f.recs[id]
	if !ok {
		return nil, nil, apierr.Errorf(apierr.NotFound, "vm %q not found", id)
	}
	vm := r.vm
	return &vm, proto.Clone(r.att).(*attestationv1.Attestation), nil
}

func (f *fakeVMs) PutVM(vm *policystore.VM, att *attestationv1.Attestation) error {
	if !f.locks.held[vm.ID] {
		f.t.Errorf("vm %s written without its lock", vm.ID)
	}
	if f.announced != 0 {
		f.t.Errorf("vm %s written with %d announcements outstanding: a commit would wait for a write already made", vm.ID, f.announced)
	}
	f.puts++
	f.recs[vm.ID] = record{*vm, proto.Clone(att).(*attestationv1.Attestation)}
	return nil
}

func (f *fakeVMs) Announce() func() {
	f.announced++
	var once sync.Once
	return func() { once.Do(func() { f.announced-- }) }
}

// put writes a record behind the verifier's back (what BeginBoot does).
func (f *fakeVMs) put(vm policystore.VM, att *attestationv1.Attestation) {
	f.recs[vm.ID] = record{vm, att}
}

func (f *fakeVMs) att(id string) *attestationv1.Attestation { return f.recs[id].att }

type fakePolicies struct {
	policies map[string]*attestationv1.ImagePolicy
	golden   map[string][]verify.Event
}

func (f *fakePolicies) SharedPolicy(image string) (*attestationv1.ImagePolicy, error) {
	p, ok := f.policies[image]
	if !ok {
		return nil, apierr.Errorf(apierr.NotFound, "no policy for image %q", image)
	}
	return p, nil
}

func (f *fakePolicies) UpdatePolicy(image string, fn func(old *attestationv1.ImagePolicy) (*attestationv1.ImagePolicy, error)) (*attestationv1.ImagePolicy, error) {
	var old *attestationv1.ImagePolicy
	if p, ok := f.policies[image]; ok {
		old = proto.Clone(p).(*attestationv1.ImagePolicy)
	}
	p, err := fn(old)
	if err != nil {
		return nil, err
	}
	f.policies[image] = p
	return p, nil
}

func (f *fakePolicies) GoldenEvents(image string) ([]verify.Event, error) {
	return f.golden[image], nil
}

func (f *fakePolicies) PutGoldenEvents(image string, events []verify.Event) error {
	f.golden[image] = events
	return nil
}

// fakeNonces are single use, per VM and boot; lost ones are what an earlier
// run issued.
type fakeNonces struct {
	live     map[string]bool
	lost     map[string]bool
	consumed int
	issuedAt map[string]time.Time // by vm id
}

func nonceKey(vm string, boot uint64, n []byte) string {
	return fmt.Sprintf("%s/%d/%x", vm, boot, n)
}

func (f *fakeNonces) issue(vm string, boot uint64, n []byte) { f.live[nonceKey(vm, boot, n)] = true }

func (f *fakeNonces) Consume(vm string, boot uint64, n []byte) nonce.Result {
	f.consumed++
	k := nonceKey(vm, boot, n)
	switch {
	case f.live[k]:
		delete(f.live, k)
		return nonce.Valid
	case f.lost[k]:
		return nonce.Lost
	}
	return nonce.Unknown
}

func (f *fakeNonces) LastIssued(vm string, _ uint64) (time.Time, bool) {
	at, ok := f.issuedAt[vm]
	return at, ok
}

type fakeLocks struct {
	held  map[string]bool
	taken int
}

func (f *fakeLocks) Lock(id string) func() {
	if f.held[id] {
		panic("vm " + id + " locked twice")
	}
	f.held[id] = true
	f.taken++
	return func() { f.held[id] = false }
}
