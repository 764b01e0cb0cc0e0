package imds

import (
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/giantswarm/vm-manager/pkg/bound"
)

// Limits bound what one VM may ask of the IMDS.
type Limits struct {
	// RequestsPerSecond and Burst are each VM's token bucket
	// (--imds-requests-per-second, --imds-request-burst): a request over it
	// is answered 429 with Retry-After.
	RequestsPerSecond float64
	Burst             int
	// MaxQuoteBytes and MaxReportBytes bound the bodies of /attest/quote and
	// /report (--imds-max-quote-bytes, --imds-max-report-bytes): 413 beyond.
	MaxQuoteBytes  int64
	MaxReportBytes int64
}

// Defaults of the limits, far above what a guest needs: a boot of the test
// guest makes a few dozen requests over seconds (hostname, keys, user-data
// polled every 2 s while gated, a nonce and a quote per stage, sysupdate
// files, a report every 15 s), and boots within 5/s and a burst of 40
// (TestBoundsFromGuests); a quote with its event logs is tens of KiB, a
// systemd-report upload of a busy host a few hundred.
const (
	DefaultRequestsPerSecond = 20
	DefaultBurst             = 100
	DefaultMaxQuoteBytes     = 1 << 20
	DefaultMaxReportBytes    = 2 << 20
)

func (l *Limits) defaults() {
	bound.Default(&l.RequestsPerSecond, DefaultRequestsPerSecond)
	bound.Default(&l.Burst, DefaultBurst)
	bound.Default(&l.MaxQuoteBytes, DefaultMaxQuoteBytes)
	bound.Default(&l.MaxReportBytes, DefaultMaxReportBytes)
}

// The bodies whose refusals are counted (Counters.BodiesTooLarge).
const (
	BodyQuote  = "quote"
	BodyReport = "report"
)

// Counters are one VM's refusals since the hypervisor started.
type Counters struct {
	VMID string
	// RateLimited counts the requests answered 429.
	RateLimited uint64
	// BodiesTooLarge counts the bodies answered 413, by BodyQuote and BodyReport.
	BodiesTooLarge map[string]uint64
}

// Guard keeps the per-VM state of the limits: a token bucket and the
// counters. One Guard serves every network's handler (a VM is on one
// network); its entries are the VMs that asked something, each removed by
// Forget when its VM is deleted, so it is bounded by the host's VMs.
type Guard struct {
	limits Limits
	now    func() time.Time

	mu  sync.Mutex
	vms map[string]*vmState
}

type vmState struct {
	tokens   float64
	last     time.Time
	limited  uint64
	tooLarge map[string]uint64
}

// NewGuard returns the guard of limits (zero fields take the defaults).
func NewGuard(limits Limits) *Guard {
	limits.defaults()
	return &Guard{limits: limits, now: time.Now, vms: map[string]*vmState{}}
}

// Limits are the guard's limits, defaults filled in.
func (g *Guard) Limits() Limits { return g.limits }

func (g *Guard) stateLocked(vmID string) *vmState {
	st := g.vms[vmID]
	if st == nil {
		st = &vmState{tokens: float64(g.limits.Burst), last: g.now()}
		g.vms[vmID] = st
	}
	return st
}

// allow takes a token of vmID's bucket; when there is none it counts the
// refusal and says how long until there is one.
func (g *Guard) allow(vmID string) (ok bool, retryAfter time.Duration) {
	g.mu.Lock()
	defer g.mu.Unlock()
	st := g.stateLocked(vmID)
	now := g.now()
	rate := g.limits.RequestsPerSecond
	if dt := now.Sub(st.last).Seconds(); dt > 0 {
		st.tokens = math.Min(float64(g.limits.Burst), st.tokens+dt*rate)
	}
	st.last = now
	if st.tokens >= 1 {
		st.tokens--
		return true, 0
	}
	st.limited++
	return false, time.Duration((1 - st.tokens) / rate * float64(time.Second))
}

func (g *Guard) tooLarge(vmID, body string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	st := g.stateLocked(vmID)
	if st.tooLarge == nil {
		st.tooLarge = map[string]uint64{}
	}
	st.tooLarge[body]++
}

// Forget drops a deleted VM's bucket and counters.
func (g *Guard) Forget(vmID string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.vms, vmID)
}

// Counters returns every VM's counters, by VM id.
func (g *Guard) Counters() []Counters {
	g.mu.Lock()
	defer g.mu.Unlock()
	out := make([]Counters, 0, len(g.vms))
	for id, st := range g.vms {
		c := Counters{VMID: id, RateLimited: st.limited, BodiesTooLarge: map[string]uint64{BodyQuote: 0, BodyReport: 0}}
		for k, v := range st.tooLarge {
			c.BodiesTooLarge[k] = v
		}
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b Counters) int { return strings.Compare(a.VMID, b.VMID) })
	return out
}
