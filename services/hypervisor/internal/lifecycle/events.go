package lifecycle

import (
	"cmp"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// Event is one change of a VM record.
type Event struct {
	// Revision counts every event, from 1, across restarts (RevisionStore).
	Revision uint64
	VMID     string
	From, To hypervisorv1.State
	// Deleted: the record is gone; Record is its last state (nil when the
	// deletion undid a create nobody saw).
	Deleted bool
	// Record is the record after the change; subscribers must not modify it.
	Record *storepb.VirtualMachine
}

// RevisionStore persists how far revisions went, so that a restarted
// hypervisor never hands out a revision a client already saw.
type RevisionStore interface {
	WatchRevision() (uint64, error)
	SetWatchRevision(uint64) error
}

// ErrRevisionGone is a resume from a revision whose following events are
// no longer retained: the subscriber must start over from a snapshot.
var ErrRevisionGone = errors.New("revision no longer retained")

// Broker numbers events and hands them to subscribers without blocking the
// VM that changed: a subscriber whose buffer is full is cut off (its
// channel closed, Lagged true, counted), never silently skipped. It keeps
// the last retain events, so a subscriber can resume after a revision it
// saw, and the current record of every VM, for snapshots.
//
// Revisions survive restarts: the broker persists a ceiling (reserveBlock
// ahead) before handing out a revision beyond it, and the exact last
// revision on Close. A restart continues above the stored value; after a
// clean stop that is exactly the last revision, so a subscriber that saw it
// resumes losing nothing; after a crash revisions skip ahead and older ones
// are refused (ErrRevisionGone), never reused.
type Broker struct {
	retain int
	store  RevisionStore

	mu       sync.Mutex
	revision uint64
	floor    uint64           // events up to floor happened before this process
	reserved uint64           // persisted ceiling
	recent   []Event          // the last retain events (up to twice as many kept), oldest first
	current  map[string]Event // the last event of each VM that exists
	subs     map[*Subscription]struct{}

	cut        atomic.Uint64
	persistErr atomic.Uint64
}

// DefaultRetain is how many events a broker keeps for late subscribers.
const DefaultRetain = 1024

// reserveBlock is how far ahead the persisted ceiling runs: one database
// write per reserveBlock events.
const reserveBlock = 1024

// NewBroker returns a broker that keeps the last retain events (DefaultRetain
// when 0). With a store, revisions continue above the stored one.
func NewBroker(retain int, store RevisionStore) (*Broker, error) {
	if retain <= 0 {
		retain = DefaultRetain
	}
	b := &Broker{retain: retain, store: store, subs: map[*Subscription]struct{}{}, current: map[string]Event{}}
	if store != nil {
		r, err := store.WatchRevision()
		if err != nil {
			return nil, fmt.Errorf("watch revision: %w", err)
		}
		b.revision, b.floor, b.reserved = r, r, r
	}
	return b, nil
}

// Seed records a VM's current record without an event (records loaded at
// start, before anything changed).
func (b *Broker) Seed(rec *storepb.VirtualMachine) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.current[rec.GetId()] = Event{Revision: b.floor, VMID: rec.GetId(), To: rec.GetState(), Record: rec}
}

// Publish numbers e and hands it to every subscriber; it returns the revision.
func (b *Broker) Publish(e Event) uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.revision++
	if b.store != nil && b.revision > b.reserved {
		b.reserved = b.revision + reserveBlock
		if err := b.store.SetWatchRevision(b.reserved); err != nil {
			b.persistErr.Add(1)
		}
	}
	e.Revision = b.revision
	if e.Deleted {
		if e.Record == nil {
			e.Record = b.current[e.VMID].Record
		}
		delete(b.current, e.VMID)
	} else {
		b.current[e.VMID] = e
	}
	// Trimmed in batches, so a change costs O(1), not a shift of the window.
	b.recent = append(b.recent, e)
	if len(b.recent) >= 2*b.retain {
		b.recent = append(make([]Event, 0, 2*b.retain), b.recent[len(b.recent)-b.retain:]...)
	}
	for s := range b.subs {
		select {
		case s.ch <- e:
		default:
			s.lagged.Store(true)
			b.cut.Add(1)
			s.closeLocked(b)
		}
	}
	return e.Revision
}

// Subscription is a subscriber's channel of events.
type Subscription struct {
	ch     chan Event
	lagged atomic.Bool
	once   sync.Once
	b      *Broker
}

// C is closed when the subscription ends: Cancel, Close, or Lagged.
func (s *Subscription) C() <-chan Event { return s.ch }

// Lagged says the subscriber did not keep up and was cut off.
func (s *Subscription) Lagged() bool { return s.lagged.Load() }

// Cancel ends the subscription and closes C.
func (s *Subscription) Cancel() {
	s.b.mu.Lock()
	defer s.b.mu.Unlock()
	s.closeLocked(s.b)
}

func (s *Subscription) closeLocked(b *Broker) {
	s.once.Do(func() {
		delete(b.subs, s)
		close(s.ch)
	})
}

// Snapshot subscribes to every event after now and returns the current
// record of every VM (oldest revision first) and the revision they are at.
func (b *Broker) Snapshot(buffer int) (sub *Subscription, current []Event, revision uint64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, e := range b.current {
		current = append(current, e)
	}
	slices.SortFunc(current, func(x, y Event) int {
		if c := cmp.Compare(x.Revision, y.Revision); c != 0 {
			return c
		}
		return cmp.Compare(x.VMID, y.VMID)
	})
	return b.subscribeLocked(nil, buffer), current, b.revision
}

// Subscribe resumes after revision since: the retained events after it
// first, then every new one, in a channel of buffer plus the backlog.
// ErrRevisionGone when events after since are not all retained (or since
// was never handed out by this broker's store).
func (b *Broker) Subscribe(since uint64, buffer int) (*Subscription, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	recent := b.recent
	if len(recent) > b.retain {
		recent = recent[len(recent)-b.retain:]
	}
	switch {
	case since > b.revision:
		return nil, fmt.Errorf("%w: revision %d is ahead of the current %d (from another host, or before a crash)", ErrRevisionGone, since, b.revision)
	case since < b.floor:
		return nil, fmt.Errorf("%w: revision %d is from before the hypervisor restarted (at %d)", ErrRevisionGone, since, b.floor)
	case since < b.revision && (len(recent) == 0 || recent[0].Revision > since+1):
		return nil, fmt.Errorf("%w: revision %d is older than the %d retained events (the oldest is %d)", ErrRevisionGone, since, b.retain, recent[0].Revision)
	}
	var backlog []Event
	for _, e := range recent {
		if e.Revision > since {
			backlog = append(backlog, e)
		}
	}
	return b.subscribeLocked(backlog, buffer), nil
}

func (b *Broker) subscribeLocked(backlog []Event, buffer int) *Subscription {
	s := &Subscription{ch: make(chan Event, buffer+len(backlog)), b: b}
	for _, e := range backlog {
		s.ch <- e
	}
	b.subs[s] = struct{}{}
	return s
}

// Revision is the last event's revision.
func (b *Broker) Revision() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.revision
}

// Cut counts subscribers cut off because their buffer was full.
func (b *Broker) Cut() uint64 { return b.cut.Load() }

// PersistErrors counts failed writes of the revision ceiling.
func (b *Broker) PersistErrors() uint64 { return b.persistErr.Load() }

// Close ends every subscription and stores the exact last revision, so the
// next process continues right after it.
func (b *Broker) Close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	for s := range b.subs {
		s.closeLocked(b)
	}
	if b.store == nil {
		return nil
	}
	b.reserved = b.revision
	return b.store.SetWatchRevision(b.revision)
}
