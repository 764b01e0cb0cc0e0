package notify

import (
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// SubscriberBuffer is the capacity of a subscription's channel.
const SubscriberBuffer = 16

// Stats counts what the router did with messages, for metrics.
type Stats struct {
	Delivered uint64 // handed to at least one subscriber
	Dropped   uint64 // lost to a full subscriber buffer (see also Router.Dropped)
	Unrouted  uint64 // no subscriber for the VM, or a vsock CID no VM holds
	Malformed uint64 // not sd_notify text
	Oversize  uint64 // longer than MaxMessage
	Refused   uint64 // vsock connections refused (too many from one CID, no vsock address)
}

// Router hands messages to per-VM subscribers. Its zero value is not usable;
// call NewRouter.
type Router struct {
	mu      sync.Mutex
	subs    map[string]map[*subscription]struct{}
	dropped map[string]uint64
	cids    map[uint32]string
	open    map[uint32]int      // open vsock connections per CID
	serial  map[string]net.Conn // the attached virtio-serial connection per VM (SendSerial)

	delivered, droppedAll, unrouted, malformed, oversize, refused atomic.Uint64

	// Tunables, changed by tests only.
	vsockReadTimeout time.Duration
	vsockPerCID      int
}

type subscription struct {
	ch chan Message
}

// NewRouter returns an empty router.
func NewRouter() *Router {
	return &Router{
		subs:             map[string]map[*subscription]struct{}{},
		dropped:          map[string]uint64{},
		cids:             map[uint32]string{},
		open:             map[uint32]int{},
		vsockReadTimeout: 5 * time.Second,
		vsockPerCID:      8,
	}
}

// Subscribe returns the messages for vmID (buffer SubscriberBuffer; overflow
// is dropped and counted) and a function that ends the subscription and
// closes the channel. Messages that arrive while nobody subscribes are lost.
func (r *Router) Subscribe(vmID string) (<-chan Message, func()) {
	s := &subscription{ch: make(chan Message, SubscriberBuffer)}
	r.mu.Lock()
	if r.subs[vmID] == nil {
		r.subs[vmID] = map[*subscription]struct{}{}
	}
	r.subs[vmID][s] = struct{}{}
	r.mu.Unlock()
	var once sync.Once
	return s.ch, func() {
		once.Do(func() {
			r.mu.Lock()
			defer r.mu.Unlock()
			delete(r.subs[vmID], s)
			if len(r.subs[vmID]) == 0 {
				delete(r.subs, vmID)
			}
			close(s.ch) // under the lock: Deliver never sends on a closed channel
		})
	}
}

// Deliver routes d to the subscribers of d.VM without blocking. Transports
// call it; it is exported for other sources (tests, future transports).
func (r *Router) Deliver(d Delivery) {
	r.mu.Lock()
	defer r.mu.Unlock()
	subs := r.subs[d.VM]
	if len(subs) == 0 {
		r.unrouted.Add(1)
		return
	}
	delivered := false
	for s := range subs {
		select {
		case s.ch <- d.Msg:
			delivered = true
		default:
			r.dropped[d.VM]++
			r.droppedAll.Add(1)
		}
	}
	if delivered {
		r.delivered.Add(1)
	}
}

// Dropped counts the messages for vmID lost to full subscriber buffers.
func (r *Router) Dropped(vmID string) uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.dropped[vmID]
}

// Forget drops vmID's counters and CID mappings (on VM deletion).
func (r *Router) Forget(vmID string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.dropped, vmID)
	for cid, vm := range r.cids {
		if vm == vmID {
			delete(r.cids, cid)
		}
	}
}

// Stats returns the router's counters.
func (r *Router) Stats() Stats {
	return Stats{
		Delivered: r.delivered.Load(),
		Dropped:   r.droppedAll.Load(),
		Unrouted:  r.unrouted.Load(),
		Malformed: r.malformed.Load(),
		Oversize:  r.oversize.Load(),
		Refused:   r.refused.Load(),
	}
}

// deliverRaw parses one framed message and routes it.
func (r *Router) deliverRaw(vmID string, b []byte, privileged bool) {
	if len(b) > MaxMessage {
		r.oversize.Add(1)
		return
	}
	m, err := Parse(b)
	if err != nil {
		r.malformed.Add(1)
		return
	}
	if len(m.Fields) == 0 {
		return // nothing said (a keep-alive NUL, an empty write)
	}
	m.Privileged = privileged
	r.Deliver(Delivery{VM: vmID, Msg: m})
}
