package vm

import (
	"context"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// onePool is the pools port with one pool of one shape; it counts.
type onePool struct {
	shape *hypervisorv1.PoolShape

	mu           sync.Mutex
	hits, misses int
}

func (p *onePool) Match(s *hypervisorv1.PoolShape) (string, bool) {
	return "small", proto.Equal(s, p.shape)
}

func (p *onePool) Counted(_ string, hit bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if hit {
		p.hits++
	} else {
		p.misses++
	}
}

// poolHarness is the suspend harness with one pool of the harness's create
// shape.
func poolHarness(t *testing.T) (*harness, *suspendDriver, *onePool) {
	t.Helper()
	h, sd := suspendHarness(t)
	shape, err := h.m.PoolShape(&hypervisorv1.CreatePoolRequest{Name: "small", RequireAttestation: proto.Bool(true), MemoryMib: proto.Int32(512), Cpus: proto.Int32(1)})
	if err != nil {
		t.Fatal(err)
	}
	p := &onePool{shape: shape}
	h.m.Close()
	h.pools = p
	h.start()
	return h, sd, p
}

// parkedMember boots a member, has its guest pass the initrd quote and ask
// for its user-data, and parks it.
func (h *harness) parkedMember(shape *hypervisorv1.PoolShape) string {
	h.t.Helper()
	ctx := context.Background()
	id, err := h.m.CreateMember(ctx, "small", shape)
	if err != nil {
		h.t.Fatal(err)
	}
	h.waitFor(id, func(v *hypervisorv1.VirtualMachine) bool { return v.GetState() == hypervisorv1.State_STATE_BOOTING })
	if err := h.m.Table.Update(id, func(r *storepb.VirtualMachine) {
		r.State = hypervisorv1.State_STATE_ATTESTING
		r.Attestation = &attestationv1.Attestation{Required: true, UserDataReleased: true, Initrd: &attestationv1.Quote{Verified: true}}
	}); err != nil {
		h.t.Fatal(err)
	}
	if !h.m.Table.PoolMemberWaiting(id) {
		h.t.Fatalf("%s is not a waiting member", id)
	}
	if err := h.m.WaitParked(ctx, id); err != nil {
		h.t.Fatal(err)
	}
	if err := h.m.Park(ctx, id); err != nil {
		h.t.Fatal(err)
	}
	return id
}

// A member is hidden from the list, parks suspended, and a create of its
// shape claims it: the caller's identity in one write, resumed where it
// waited (attesting), no new boot, no new vTPM keys.
func TestPoolClaimGivesTheCallersIdentity(t *testing.T) {
	h, _, p := poolHarness(t)
	id := h.parkedMember(p.shape)
	member, _ := h.m.Get(id)
	if member.GetState() != hypervisorv1.State_STATE_SUSPENDED || member.GetName() != memberName("small", id) {
		t.Fatalf("member %v", member)
	}
	for _, v := range h.m.List() {
		if v.GetId() == id {
			t.Fatalf("the list shows member %s", id)
		}
	}
	if h.m.Table.PoolMemberWaiting("nosuchvm") {
		t.Error("an unknown vm waits as a member")
	}
	launches := h.drv.launchCount()
	v, err := h.m.Create(context.Background(), &hypervisorv1.CreateVirtualMachineRequest{
		Name: "claimer", Hostname: "claimer-host", RequireAttestation: proto.Bool(true), MemoryMib: proto.Int32(512), Cpus: proto.Int32(1),
		SshAuthorizedKeys: []string{"ssh-ed25519 AAAA claimer"}, Metadata: map[string]string{"role": "sandbox"},
		UserData: `{"ignition":{"version":"3.4.0"}}`, Ttl: "1h", WaitFor: hypervisorv1.WaitFor_WAIT_FOR_NONE,
	}, "alice")
	if err != nil {
		t.Fatal(err)
	}
	if v.GetId() != id || v.GetFromPool() != "small" || v.GetClaimedAt() == nil || v.GetName() != "claimer" || v.GetHostname() != "claimer-host" ||
		v.GetCreatedBy() != "alice" || v.GetMetadata()["role"] != "sandbox" || v.GetLifetime().GetExpireAt() == nil ||
		v.GetState() != hypervisorv1.State_STATE_ATTESTING || v.GetProcesses() == nil {
		t.Fatalf("claimed: %v", v)
	}
	if h.drv.launchCount() != launches || v.GetBootCount() != member.GetBootCount() || v.GetTpm().GetAkFingerprint() != member.GetTpm().GetAkFingerprint() {
		t.Errorf("the claim booted again or changed the vTPM: launches %d→%d, boot %d→%d", launches, h.drv.launchCount(), member.GetBootCount(), v.GetBootCount())
	}
	if b, err := os.ReadFile(v.GetPaths().GetUserData()); err != nil || string(b) != `{"ignition":{"version":"3.4.0"}}` {
		t.Errorf("user-data %q %v", b, err)
	}
	if h.m.Table.PoolMemberWaiting(id) {
		t.Error("a claimed VM still waits as a member")
	}
	if keys := h.m.guest.SSHKeys(id); len(keys) == 0 || keys[len(keys)-1] != "ssh-ed25519 AAAA claimer" {
		t.Errorf("IMDS keys %v", keys)
	}
	rec, _ := h.st.GetVM(id)
	if rec.GetPool() != "" || rec.GetFromPool() != "small" || rec.GetName() != "claimer" {
		t.Errorf("stored: pool %q from %q name %q", rec.GetPool(), rec.GetFromPool(), rec.GetName())
	}
	if p.hits != 1 || p.misses != 0 {
		t.Errorf("hits %d misses %d", p.hits, p.misses)
	}
	// The pool is empty now: the next create boots cold and counts a miss.
	v2, err := h.m.Create(context.Background(), &hypervisorv1.CreateVirtualMachineRequest{Name: "cold", RequireAttestation: proto.Bool(true),
		MemoryMib: proto.Int32(512), Cpus: proto.Int32(1), WaitFor: hypervisorv1.WaitFor_WAIT_FOR_NONE}, "bob")
	if err != nil || v2.GetFromPool() != "" || p.misses != 1 {
		t.Errorf("cold create: %v %v, misses %d", v2, err, p.misses)
	}
}

// Concurrent creates of the shape: each member goes to one of them, the
// others boot cold.
func TestPoolConcurrentClaimsNeverShareAMember(t *testing.T) {
	h, _, p := poolHarness(t)
	members := map[string]bool{h.parkedMember(p.shape): true, h.parkedMember(p.shape): true}
	// Every claim that chose a member waits until both members are chosen:
	// the choices all happen before any claim's write, the window two
	// claims of one member would race in (with the marking removed, more
	// claims choose, and some choose the same member).
	var picked atomic.Int32
	allPicked := make(chan struct{})
	afterPick = func() {
		if picked.Add(1) == int32(len(members)) {
			close(allPicked)
		}
		select {
		case <-allPicked:
		case <-time.After(poll.Bound): // a bound, should a choice never come
		}
	}
	t.Cleanup(func() { afterPick = nil })
	const n = 6
	var wg sync.WaitGroup
	got := make([]*hypervisorv1.VirtualMachine, n)
	for i := range n {
		wg.Go(func() {
			v, err := h.m.Create(context.Background(), &hypervisorv1.CreateVirtualMachineRequest{Name: "c" + string(rune('a'+i)), RequireAttestation: proto.Bool(true),
				MemoryMib: proto.Int32(512), Cpus: proto.Int32(1), WaitFor: hypervisorv1.WaitFor_WAIT_FOR_NONE}, "tester")
			if err != nil {
				t.Error(err)
			}
			got[i] = v
		})
	}
	wg.Wait()
	claimed := map[string]string{}
	for _, v := range got {
		if v.GetFromPool() == "" {
			continue
		}
		if other, dup := claimed[v.GetId()]; dup {
			t.Errorf("member %s handed to %s and %s", v.GetId(), other, v.GetName())
		}
		claimed[v.GetId()] = v.GetName()
		if !members[v.GetId()] {
			t.Errorf("%s claimed %s, not a member", v.GetName(), v.GetId())
		}
	}
	if len(claimed) != 2 || p.hits != 2 || p.misses != n-2 {
		t.Errorf("claimed %v, hits %d, misses %d", claimed, p.hits, p.misses)
	}
}

// A claim stored before a kill, whose resume did not happen: the next
// hypervisor resumes it (the claimer is owed a running VM); a VM suspended
// after its claim stays suspended.
func TestPoolClaimResumedAfterRestart(t *testing.T) {
	h, _, p := poolHarness(t)
	pending, later := h.parkedMember(p.shape), h.parkedMember(p.shape)
	h.m.Close()
	for _, id := range []string{pending, later} {
		rec, err := h.st.GetVM(id)
		if err != nil {
			t.Fatal(err)
		}
		claimed := rec.GetSuspendedAt().AsTime().Add(1e9)
		if id == later {
			claimed = rec.GetSuspendedAt().AsTime().Add(-1e9)
		}
		rec.Pool, rec.FromPool, rec.Name, rec.ClaimedAt = "", "small", "n"+id, timestamppb.New(claimed)
		if err := h.st.PutVM(rec); err != nil {
			t.Fatal(err)
		}
	}
	h.start()
	h.waitFor(pending, func(v *hypervisorv1.VirtualMachine) bool {
		return v.GetState() == hypervisorv1.State_STATE_ATTESTING && v.GetProcesses() != nil
	})
	if v, _ := h.m.Get(later); v.GetState() != hypervisorv1.State_STATE_SUSPENDED {
		t.Errorf("a VM suspended after its claim was resumed: %v", v.GetState())
	}
}
