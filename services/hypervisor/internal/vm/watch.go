package vm

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/bound"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/lifecycle"
)

// WatchLimits bound the watch streams.
type WatchLimits struct {
	// MaxWatchers bounds the open watch streams (--max-watchers); one more
	// is refused with resource_exhausted, counted under "watchers".
	MaxWatchers int
	// Buffer is each watcher's queue of events not yet sent
	// (--watch-buffer); a watcher that falls that far behind is cut off with
	// resource_exhausted, counted under "watch_buffer", and resumes from its
	// last revision.
	Buffer int
	// Retain is how many events are kept for resumes (--watch-retain): a
	// client that falls further behind gets out_of_range and lists again.
	Retain int
	// BookmarkInterval is how often a quiet stream gets a BOOKMARK with the
	// current revision; 0: DefaultBookmarkInterval.
	BookmarkInterval time.Duration
}

// Defaults of the watch bounds.
const (
	DefaultMaxWatchers      = 256
	DefaultWatchBuffer      = 1024
	DefaultWatchRetain      = lifecycle.DefaultRetain
	DefaultBookmarkInterval = 30 * time.Second
)

// The watch's counters, under the bound names refused_total reports.
const (
	LimitWatchers    = "watchers"
	LimitWatchBuffer = "watch_buffer"
)

func (l *WatchLimits) defaults() {
	bound.Default(&l.MaxWatchers, DefaultMaxWatchers)
	bound.Default(&l.Buffer, DefaultWatchBuffer)
	bound.Default(&l.Retain, DefaultWatchRetain)
	bound.Default(&l.BookmarkInterval, DefaultBookmarkInterval)
}

// watchers counts the open watch streams, the refused and the cut ones;
// end ends them all (End).
type watchers struct {
	open    atomic.Int64
	refused atomic.Uint64
	cut     atomic.Uint64
	end     sync.Once
	ended   chan struct{}
}

// Watches are the watch streams, fed by the Table's events.
type Watches struct {
	limits   WatchLimits
	events   *lifecycle.Broker
	watchers watchers
}

// NewWatches streams the events of a Table (Table.Events).
func NewWatches(limits WatchLimits, events *lifecycle.Broker) *Watches {
	limits.defaults()
	ws := &Watches{limits: limits, events: events}
	ws.watchers.ended = make(chan struct{})
	return ws
}

// End ends every watch stream (and refuses new ones) with unavailable,
// naming the revision to resume from: the hypervisor is stopping, and a
// stream never ends by itself.
func (ws *Watches) End() { ws.watchers.end.Do(func() { close(ws.watchers.ended) }) }

// newEvents is the broker, continuing the revisions the store kept.
func newEvents(st Store, retain int) (*lifecycle.Broker, error) {
	rs, _ := st.(lifecycle.RevisionStore) // test stores may keep none
	return lifecycle.NewBroker(retain, rs)
}

// Watch sends the VMs' changes to send until ctx ends or send fails: with
// since 0 a snapshot of the matching VMs and SYNCED, else the retained
// changes after since and SYNCED; then every change. Filters: a VM id, a
// VM name (both: both must match).
func (ws *Watches) Watch(ctx context.Context, req *hypervisorv1.WatchVirtualMachinesRequest, send func(*hypervisorv1.WatchVirtualMachinesResponse) error) error {
	id, name := req.GetId(), req.GetName()
	if id != "" && !vmID.MatchString(id) {
		return apierr.Errorf(apierr.InvalidRequest, "id %.64q is not a VM id (8 hex characters)", id)
	}
	if name != "" && (len(name) > 63 || !dnsLabel.MatchString(name)) {
		return apierr.Errorf(apierr.InvalidRequest, "name %.64q is not a DNS label", name)
	}
	select {
	case <-ws.watchers.ended:
		return apierr.Errorf(apierr.Unavailable, "the hypervisor is shutting down")
	default:
	}
	lim := ws.limits
	if n := ws.watchers.open.Add(1); n > int64(lim.MaxWatchers) {
		ws.watchers.open.Add(-1)
		ws.watchers.refused.Add(1)
		return apierr.Errorf(apierr.ResourceExhausted, "%d watch streams are open, at most %d (--max-watchers)", n-1, lim.MaxWatchers)
	}
	defer ws.watchers.open.Add(-1)

	// Unclaimed pool members are not the callers' VMs: they appear with
	// their claim (whose record says from_pool), unless watched by id.
	match := func(e lifecycle.Event) bool {
		return (id == "" || e.VMID == id) && (name == "" || e.Record.GetName() == name) && (id != "" || !isMember(e.Record))
	}
	var sub *lifecycle.Subscription
	var last uint64 // the revision the client has seen everything up to
	if since := req.GetSinceRevision(); since > 0 {
		s, err := ws.events.Subscribe(since, lim.Buffer)
		if err != nil {
			return apierr.Errorf(apierr.OutOfRange, "cannot resume the watch: %v; list the VMs again, then watch without since_revision", err)
		}
		sub, last = s, since
	} else {
		s, current, rev := ws.events.Snapshot(lim.Buffer)
		sub, last = s, rev
		found := false
		for _, e := range current {
			if !match(e) {
				continue
			}
			found = true
			if err := send(&hypervisorv1.WatchVirtualMachinesResponse{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SNAPSHOT, Revision: rev, Vm: View(e.Record)}); err != nil {
				sub.Cancel()
				return err
			}
		}
		if id != "" && !found {
			sub.Cancel()
			return apierr.Errorf(apierr.NotFound, "vm %q not found", id)
		}
	}
	defer sub.Cancel()
	// SYNCED ends the snapshot; on a resume it comes after the backlog, so
	// a client knows it has caught up.
	backlog := len(sub.C())
	synced := func() error {
		return send(&hypervisorv1.WatchVirtualMachinesResponse{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_SYNCED, Revision: last})
	}
	if backlog == 0 {
		if err := synced(); err != nil {
			return err
		}
	}
	quiet := true // nothing sent since the last bookmark tick
	deliver := func(e lifecycle.Event) error {
		last = e.Revision
		if !match(e) {
			return nil
		}
		quiet = false
		msg := &hypervisorv1.WatchVirtualMachinesResponse{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_CHANGED, Revision: e.Revision, Vm: View(e.Record), PreviousState: e.From}
		if e.Deleted {
			msg.Type = hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_DELETED
		}
		return send(msg)
	}
	bookmark := time.NewTicker(lim.BookmarkInterval)
	defer bookmark.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ws.watchers.ended:
			// What was published before the end is sent first: after a
			// clean stop the next hypervisor continues right after it.
			for {
				select {
				case e, ok := <-sub.C():
					if ok {
						if err := deliver(e); err != nil {
							return err
						}
						continue
					}
				default:
				}
				return apierr.Errorf(apierr.Unavailable, "the hypervisor is shutting down; watch again with since_revision %d", last)
			}
		case <-bookmark.C:
			// A quiet stream still learns the revision (events of other VMs
			// move it): resuming from it outlives the retention window.
			if quiet {
				if err := send(&hypervisorv1.WatchVirtualMachinesResponse{Type: hypervisorv1.WatchEventType_WATCH_EVENT_TYPE_BOOKMARK, Revision: last}); err != nil {
					return err
				}
			}
			quiet = true
		case e, ok := <-sub.C():
			if !ok {
				if sub.Lagged() {
					ws.watchers.cut.Add(1)
					return apierr.Errorf(apierr.ResourceExhausted, "the watch fell %d events behind (--watch-buffer) and was cut off; watch again with since_revision %d", lim.Buffer, last)
				}
				return apierr.Errorf(apierr.Unavailable, "the hypervisor is shutting down; watch again with since_revision %d", last)
			}
			if err := deliver(e); err != nil {
				return err
			}
			if backlog > 0 {
				if backlog--; backlog == 0 {
					if err := synced(); err != nil {
						return err
					}
				}
			}
		}
	}
}

// WatchCounters are the open watch streams, and those refused at
// --max-watchers or cut off at --watch-buffer since the hypervisor started.
func (ws *Watches) WatchCounters() (open int64, refused, cut uint64) {
	return ws.watchers.open.Load(), ws.watchers.refused.Load(), ws.watchers.cut.Load()
}
