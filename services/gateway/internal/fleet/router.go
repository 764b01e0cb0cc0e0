package fleet

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

// DefaultNodeTimeout bounds one node's part of a fan-out (lists, the host
// summary, placement): a node slower than this makes the result partial
// instead of holding every caller up.
const DefaultNodeTimeout = 5 * time.Second

// node is a member with its connection.
type node struct {
	Member
	conn *grpc.ClientConn // nil when it could not be dialled (dialErr)
	hv   hypervisorv1.HypervisorServiceClient
	at   attestationv1.AttestationServiceClient
	// dialErr is why conn is nil: its VMs answer unavailable, not
	// not_found, as for any node discovery knows but cannot reach.
	dialErr error
	// goneSince is when discovery stopped reporting the member (a pod
	// being recreated has no address, so no endpoint): for GoneRetention
	// its VMs answer unavailable and lists warn, instead of not_found and
	// a silent gap.
	goneSince time.Time
}

// GoneRetention is how long a member discovery no longer reports is still
// known (unavailable, named in lists' warnings) before it is forgotten: long
// enough for a pod's recreation, short enough that a node scaled away on
// purpose stops being warned about.
const GoneRetention = 10 * time.Minute

// usable is nil for a node calls can go to, else why not.
func (n *node) usable() error {
	switch {
	case !n.goneSince.IsZero():
		return unavailable(n, "gone from discovery since "+n.goneSince.UTC().Format(time.RFC3339)+" (its pod may be restarting)")
	case !n.Ready:
		return unavailable(n, "not ready")
	case n.conn == nil:
		return unavailable(n, n.dialErr.Error())
	}
	return nil
}

// expired is a gone member past its retention: forgotten.
func (n *node) expired(retention time.Duration) bool {
	return !n.goneSince.IsZero() && time.Since(n.goneSince) >= retention
}

// Dialer opens a member's connection (Dial: TLS or loopback plaintext, the
// caller's authorization forwarded).
type Dialer func(Member) (*grpc.ClientConn, error)

// Router is the fleet: the members discovery reports, one connection each,
// and the public services implemented over them (hypervisor.go,
// attestation.go, watch.go).
type Router struct {
	disc        Discovery
	dial        Dialer
	log         *slog.Logger
	nodeTimeout time.Duration
	// goneRetention is GoneRetention (tests shorten it).
	goneRetention time.Duration

	mu      sync.RWMutex
	byIndex map[int]*node
	known   bool          // discovery reported at least once
	changed chan struct{} // closed and replaced on every update (watch.go)
}

// NewRouter returns a router over disc's members, dialled with dial.
func NewRouter(disc Discovery, dial Dialer, log *slog.Logger) *Router {
	return &Router{disc: disc, dial: dial, log: log, nodeTimeout: DefaultNodeTimeout, goneRetention: GoneRetention,
		byIndex: map[int]*node{}, changed: make(chan struct{})}
}

// Run follows discovery until ctx ends, then closes the connections.
func (r *Router) Run(ctx context.Context) error {
	err := r.disc.Run(ctx, r.update)
	r.mu.Lock()
	defer r.mu.Unlock()
	for i, n := range r.byIndex {
		if n.conn != nil {
			_ = n.conn.Close()
		}
		delete(r.byIndex, i)
	}
	return err
}

// update applies a new member set: a member whose address and server name
// are unchanged keeps its connection (its readiness and labels may change);
// others are dialled anew, and the connections of members gone are closed.
func (r *Router) update(members []Member) {
	r.mu.Lock()
	defer r.mu.Unlock()
	next := map[int]*node{}
	for _, m := range members {
		if _, dup := next[m.Index]; dup {
			r.log.Warn("fleet: two members with one index; the second is ignored", "index", m.Index, "name", m.Name)
			continue
		}
		if old := r.byIndex[m.Index]; old != nil && old.conn != nil && old.Addr == m.Addr && old.ServerName == m.ServerName {
			n := *old
			n.Member = m
			next[m.Index] = &n
			continue
		}
		conn, err := r.dial(m)
		if err != nil {
			r.log.Warn("fleet: cannot dial node", "node", m.Name, "addr", m.Addr, "error", err)
			next[m.Index] = &node{Member: m, dialErr: err}
			continue
		}
		next[m.Index] = &node{Member: m, conn: conn,
			hv: hypervisorv1.NewHypervisorServiceClient(conn), at: attestationv1.NewAttestationServiceClient(conn)}
	}
	now := time.Now()
	for i, old := range r.byIndex {
		n := next[i]
		if old.conn != nil && (n == nil || n.conn != old.conn) {
			_ = old.conn.Close()
		}
		if n == nil && (old.goneSince.IsZero() || now.Sub(old.goneSince) < r.goneRetention) {
			gone := &node{Member: old.Member, goneSince: old.goneSince}
			if gone.goneSince.IsZero() {
				gone.goneSince = now
			}
			gone.Ready = false
			next[i] = gone
		}
	}
	r.byIndex, r.known = next, true
	close(r.changed)
	r.changed = make(chan struct{})
	r.log.Info("fleet members", "nodes", len(next))
}

// nodes is the current members by index, and a channel closed at the next
// change.
func (r *Router) nodes() ([]*node, <-chan struct{}) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	out := make([]*node, 0, len(r.byIndex))
	for _, n := range r.byIndex {
		if n.expired(r.goneRetention) {
			continue
		}
		out = append(out, n)
	}
	slices.SortFunc(out, func(a, b *node) int { return a.Index - b.Index })
	return out, r.changed
}

// forVM is the node a VM id names: not_found for an id naming no member (or
// no index at all), unavailable for a member that is not ready.
func (r *Router) forVM(id string) (*node, error) {
	i, ok := IndexOf(id)
	if !ok {
		return nil, apierr.Errorf(apierr.NotFound, "vm %q not found", id)
	}
	r.mu.RLock()
	n, retention := r.byIndex[i], r.goneRetention
	r.mu.RUnlock()
	if n == nil || n.expired(retention) {
		return nil, apierr.Errorf(apierr.NotFound, "vm %q not found (no fleet node has index %d)", id, i)
	}
	if err := n.usable(); err != nil {
		return nil, err
	}
	return n, nil
}

// onNamed runs f on the member called name, for calls with an explicit
// node: named's error when there is none or it is not ready, else f's
// answer, its error as nodeErr says.
func onNamed[T any](ctx context.Context, r *Router, name string, f func(context.Context, *node) (T, error)) (T, error) {
	n, err := r.named(name)
	if err != nil {
		var zero T
		return zero, err
	}
	v, err := f(ctx, n)
	return v, nodeErr(ctx, n, err)
}

// named is the member called name, for calls with an explicit node.
func (r *Router) named(name string) (*node, error) {
	ns, _ := r.nodes()
	for _, n := range ns {
		if n.Name == name {
			if err := n.usable(); err != nil {
				return nil, err
			}
			return n, nil
		}
	}
	return nil, apierr.Errorf(apierr.NotFound, "fleet node %q not found", name)
}

func unavailable(n *node, why string) error {
	return apierr.Errorf(apierr.Unavailable, "fleet node %s is unavailable: %s", n.Name, why)
}

// nodeErr is what a node's call returned, for the fleet's caller: what the
// node said itself passes unchanged; a failed connection or a node that did
// not answer in time is unavailable naming the node.
func nodeErr(ctx context.Context, n *node, err error) error {
	if err == nil || apierr.HasErrorInfo(err) {
		return err
	}
	st, ok := status.FromError(err)
	if !ok {
		return err
	}
	switch st.Code() {
	case codes.Unavailable, codes.DeadlineExceeded:
	case codes.Canceled:
		if ctx.Err() != nil {
			return err
		}
	default:
		return err
	}
	return unavailable(n, st.Message())
}

// result is one node's answer in a fan-out.
type result[T any] struct {
	node *node
	val  T
	err  error
}

// fanOut calls f on every member at once (not ready ones answer unavailable
// without a call), each bounded by the node timeout, and returns the answers
// in index order.
func fanOut[T any](ctx context.Context, r *Router, f func(ctx context.Context, n *node) (T, error)) []result[T] {
	ns, _ := r.nodes()
	out := make([]result[T], len(ns))
	var wg sync.WaitGroup
	for i, n := range ns {
		out[i].node = n
		if err := n.usable(); err != nil {
			out[i].err = err
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			cctx, cancel := context.WithTimeout(ctx, r.nodeTimeout)
			defer cancel()
			v, err := f(cctx, n)
			out[i].val, out[i].err = v, nodeErr(cctx, n, err)
		}()
	}
	wg.Wait()
	return out
}

// warning is a partial result's line for a node that did not answer.
func warning(n *node, err error) string {
	return fmt.Sprintf("node %s did not answer: %s", n.Name, apierr.MessageOf(err))
}

// Healthy reports whether at least one member answers its health check
// within a second: the fleet gateway's readiness.
func (r *Router) Healthy(ctx context.Context) error {
	res := fanOut(ctx, r, func(ctx context.Context, n *node) (bool, error) {
		ctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		resp, err := healthpb.NewHealthClient(n.conn).Check(ctx, &healthpb.HealthCheckRequest{})
		if err == nil && resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			return false, apierr.Errorf(apierr.Unavailable, "status %s", resp.GetStatus())
		}
		return err == nil, err
	})
	var problems []string
	for _, x := range res {
		if x.err == nil {
			return nil
		}
		problems = append(problems, warning(x.node, x.err))
	}
	if len(res) == 0 {
		return apierr.Errorf(apierr.Unavailable, "no fleet nodes known")
	}
	return apierr.Errorf(apierr.Unavailable, "no fleet node ready: %v", problems)
}

// everywhere runs f on the named node, or on every node; the answer is the
// first node's (by index), or, when some failed, an error naming them (what
// succeeded elsewhere is kept: the caller retries, and the nodes that have
// it answer conflict). A nil answer with no error means "nothing to do here".
func everywhere[T comparable](ctx context.Context, r *Router, name string, f func(context.Context, *node) (T, error)) (T, error) {
	var zero T
	if name != "" {
		return onNamed(ctx, r, name, f)
	}
	res := fanOut(ctx, r, f)
	if len(res) == 0 {
		return zero, apierr.Errorf(apierr.Unavailable, "no fleet nodes known")
	}
	var first T
	var failed []string
	var firstErr error
	for _, x := range res {
		if x.err != nil {
			failed = append(failed, fmt.Sprintf("%s: %s", x.node.Name, apierr.MessageOf(x.err)))
			if firstErr == nil {
				firstErr = x.err
			}
			continue
		}
		if first == zero {
			first = x.val
		}
	}
	if firstErr != nil {
		return zero, apierr.Errorf(apierr.CodeOf(firstErr), "failed on %d of %d fleet nodes (the others succeeded): %s",
			len(failed), len(res), strings.Join(failed, "; "))
	}
	return first, nil
}
