package lifecycle

import (
	"sync"
	"sync/atomic"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/store/storepb"
)

// Event is one change of a VM record.
type Event struct {
	// Revision counts every event of this process, from 1.
	Revision uint64
	VMID     string
	From, To hypervisorv1.State
	// Deleted: the record is gone (Record is nil then).
	Deleted bool
	// Record is the record after the change; subscribers must not modify it.
	Record *storepb.VirtualMachine
}

// Broker numbers events and hands them to subscribers without blocking the
// VM that changed: a subscriber whose buffer is full loses the event, and
// the loss is counted. It keeps the last Retain events, so a subscriber can
// pick up from a revision it saw.
type Broker struct {
	retain int

	mu       sync.Mutex
	revision uint64
	recent   []Event // the last retain events, oldest first
	subs     map[*sub]struct{}

	dropped atomic.Uint64
}

type sub struct{ ch chan Event }

// DefaultRetain is how many events a broker keeps for late subscribers.
const DefaultRetain = 1024

// NewBroker returns a broker that keeps the last retain events (DefaultRetain when 0).
func NewBroker(retain int) *Broker {
	if retain <= 0 {
		retain = DefaultRetain
	}
	return &Broker{retain: retain, subs: map[*sub]struct{}{}}
}

// Publish numbers e and hands it to every subscriber; it returns the revision.
func (b *Broker) Publish(e Event) uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.revision++
	e.Revision = b.revision
	b.recent = append(b.recent, e)
	if len(b.recent) > b.retain {
		b.recent = b.recent[len(b.recent)-b.retain:]
	}
	for s := range b.subs {
		select {
		case s.ch <- e:
		default:
			b.dropped.Add(1)
		}
	}
	return e.Revision
}

// Subscribe returns the events after revision since (0: only new ones),
// those still retained first, then every new one, in a channel of the given
// buffer; cancel ends the subscription and closes the channel. ok is false
// when events after since are no longer retained (the caller starts over).
func (b *Broker) Subscribe(since uint64, buffer int) (events <-chan Event, cancel func(), ok bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	var backlog []Event
	ok = true
	if since > 0 && since < b.revision {
		if len(b.recent) == 0 || b.recent[0].Revision > since+1 {
			ok = false
		}
		for _, e := range b.recent {
			if e.Revision > since {
				backlog = append(backlog, e)
			}
		}
	}
	s := &sub{ch: make(chan Event, buffer+len(backlog))}
	for _, e := range backlog {
		s.ch <- e
	}
	b.subs[s] = struct{}{}
	var once sync.Once
	return s.ch, func() {
		once.Do(func() {
			b.mu.Lock()
			defer b.mu.Unlock()
			delete(b.subs, s)
			close(s.ch)
		})
	}, ok
}

// Revision is the last event's revision.
func (b *Broker) Revision() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.revision
}

// Dropped counts events lost to full subscriber buffers.
func (b *Broker) Dropped() uint64 { return b.dropped.Load() }
