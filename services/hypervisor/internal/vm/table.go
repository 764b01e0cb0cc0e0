package vm

import (
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/lifecycle"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/protobuf/proto"
)

// Table is the VM records and the lifecycle table: every change of a record
// is checked against the legal state changes, persisted, published as an
// event and wakes the record's waiters (updateLocked). It also indexes the
// records by lease, for the IMDS's lookup of its caller on every request.
type Table struct {
	cfg   Config
	log   *slog.Logger
	store Store
	newID func() string // random VM ids; tests pick their own

	mu       sync.Mutex
	machines map[string]*machine
	// leases index the machines by address (Leased).
	leases  map[lease]*machine
	closing bool // the hypervisor is stopping: nothing new is launched

	events  *lifecycle.Broker
	illegal atomic.Uint64
}

// NewTable loads the stored records; nothing runs yet (New re-adopts).
func NewTable(cfg Config, log *slog.Logger, st Store) (*Table, error) {
	cfg.defaults()
	tb := &Table{cfg: cfg, log: log, store: st, newID: newID, machines: map[string]*machine{}, leases: map[lease]*machine{}}
	if p := cfg.IDPrefix; p != "" {
		tb.newID = func() string { return p + newID()[len(p):] }
	}
	var err error
	if tb.events, err = newEvents(st, cfg.Watch.Retain); err != nil {
		return nil, err
	}
	recs, err := st.ListVMs()
	if err != nil {
		return nil, fmt.Errorf("load vm records: %w", err)
	}
	for _, rec := range recs {
		tb.events.Seed(proto.Clone(rec).(*storepb.VirtualMachine)) // restore's changes are events after it
		mc := &machine{id: rec.GetId(), rec: rec, changed: make(chan struct{})}
		tb.machines[mc.id] = mc
		if l, ok := leaseOf(rec); ok {
			tb.leases[l] = mc
		}
	}
	return tb, nil
}

// Close stores the watch revision; after the Manager's Close.
func (tb *Table) Close() error { return tb.events.Close() }

// all is every machine, in no order.
func (tb *Table) all() []*machine {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	out := make([]*machine, 0, len(tb.machines))
	for _, mc := range tb.machines {
		out = append(out, mc)
	}
	return out
}

// isClosing says whether the hypervisor is stopping.
func (tb *Table) isClosing() bool {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	return tb.closing
}

func (tb *Table) vmDir(id string) string { return filepath.Join(tb.cfg.StateDir, "vms", id) }

func (tb *Table) get(id string) (*machine, error) {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	if mc, ok := tb.machines[id]; ok && vmID.MatchString(id) {
		return mc, nil
	}
	return nil, apierr.Errorf(apierr.NotFound, "vm %q not found", id)
}

// snapshot returns a copy of the record and the channel closed on its next change.
func (mc *machine) snapshot() (*storepb.VirtualMachine, <-chan struct{}) {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	return proto.Clone(mc.rec).(*storepb.VirtualMachine), mc.changed
}

// update applies fn to the record under its lock, persists it and wakes waiters.
func (tb *Table) update(mc *machine, fn func(rec *storepb.VirtualMachine)) *storepb.VirtualMachine {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	return tb.updateLocked(mc, fn)
}

// Every change goes through the lifecycle's table: a state change it does
// not allow is a bug, and the record stays as it was (logged and counted).
// Every accepted change is persisted and published as an event.
func (tb *Table) updateLocked(mc *machine, fn func(rec *storepb.VirtualMachine)) *storepb.VirtualMachine {
	prev := proto.Clone(mc.rec).(*storepb.VirtualMachine)
	before := mc.rec.GetState()
	fn(mc.rec)
	after := mc.rec.GetState()
	if err := lifecycle.Check(before, after); err != nil {
		tb.illegal.Add(1)
		tb.log.Error("vm record change refused", "vm", mc.id, "error", err)
		mc.rec = prev
		return proto.Clone(prev).(*storepb.VirtualMachine)
	}
	if err := tb.store.PutVM(mc.rec); err != nil {
		tb.log.Error("persist vm record", "vm", mc.id, "error", err)
	}
	if after != before {
		tb.log.Info("vm state", "vm", mc.id, "name", mc.rec.GetName(), "from", lifecycle.Name(before), "to", lifecycle.Name(after), "last_error", firstLine(mc.rec.GetLastError()))
	}
	out := proto.Clone(mc.rec).(*storepb.VirtualMachine)
	tb.events.Publish(lifecycle.Event{VMID: mc.id, From: before, To: after, Record: out})
	close(mc.changed)
	mc.changed = make(chan struct{})
	return proto.Clone(out).(*storepb.VirtualMachine)
}

// Events are the VMs' record changes, numbered.
func (tb *Table) Events() *lifecycle.Broker { return tb.events }

// IllegalTransitions counts the state changes the lifecycle refused (bugs).
func (tb *Table) IllegalTransitions() uint64 { return tb.illegal.Load() }

// gone publishes a VM's deletion.
func (tb *Table) gone(id string, last hypervisorv1.State) {
	tb.events.Publish(lifecycle.Event{VMID: id, From: last, To: last, Deleted: true})
}

// Update applies fn to a VM's record, persists it and wakes its waiters.
func (tb *Table) Update(id string, fn func(*storepb.VirtualMachine)) error {
	mc, err := tb.get(id)
	if err != nil {
		return err
	}
	tb.update(mc, fn)
	return nil
}

// Get returns one VM.
func (tb *Table) Get(id string) (*hypervisorv1.VirtualMachine, error) {
	rec, err := tb.Record(id)
	return View(rec), err
}

// Record returns a copy of one VM's stored record.
func (tb *Table) Record(id string) (*storepb.VirtualMachine, error) {
	mc, err := tb.get(id)
	if err != nil {
		return nil, err
	}
	rec, _ := mc.snapshot()
	return rec, nil
}

// List returns every VM, oldest first, but the unclaimed members of warm
// pools (the pools list them).
func (tb *Table) List() []*hypervisorv1.VirtualMachine {
	recs := tb.Records()
	out := make([]*hypervisorv1.VirtualMachine, 0, len(recs))
	for _, r := range recs {
		if !isMember(r) {
			out = append(out, View(r))
		}
	}
	return out
}

// Leased calls fn with the record of the VM holding the lease on ip in
// network, under the record's lock (guestapi.Records).
func (tb *Table) Leased(network string, ip netip.Addr, fn func(*storepb.VirtualMachine)) bool {
	tb.mu.Lock()
	mc := tb.leases[lease{network, ip.Unmap()}]
	tb.mu.Unlock()
	if mc == nil {
		return false
	}
	mc.mu.Lock()
	defer mc.mu.Unlock()
	fn(mc.rec)
	return true
}

// Records returns copies of every stored record, oldest first.
func (tb *Table) Records() []*storepb.VirtualMachine {
	tb.mu.Lock()
	mcs := make([]*machine, 0, len(tb.machines))
	for _, mc := range tb.machines {
		mcs = append(mcs, mc)
	}
	tb.mu.Unlock()
	out := make([]*storepb.VirtualMachine, 0, len(mcs))
	for _, mc := range mcs {
		rec, _ := mc.snapshot()
		out = append(out, rec)
	}
	slices.SortFunc(out, func(a, b *storepb.VirtualMachine) int {
		if c := a.GetCreatedAt().AsTime().Compare(b.GetCreatedAt().AsTime()); c != 0 {
			return c
		}
		return compareStrings(a.GetId(), b.GetId())
	})
	return out
}

func compareStrings(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// AttachedTo names a VM attached to the network, if any: what the network
// registry asks before it deletes one.
func (tb *Table) AttachedTo(network string) (string, bool) {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	for _, mc := range tb.machines {
		mc.mu.Lock()
		attached := mc.rec.GetNetwork() == network
		mc.mu.Unlock()
		if attached {
			return mc.id, true
		}
	}
	return "", false
}
