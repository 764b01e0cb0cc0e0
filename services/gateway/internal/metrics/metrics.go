// Package metrics is the gateway's Prometheus exposition (contract §10): the
// host and guest collectors, which ask the hypervisor at scrape time, the build info,
// the Go and process collectors, and request metrics for the REST, gRPC and
// MCP surfaces.
package metrics

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"runtime"
	"slices"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/buildinfo"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Surfaces of the request metrics.
const (
	SurfaceREST = "rest"
	SurfaceGRPC = "grpc"
	SurfaceMCP  = "mcp"
)

// DefaultScrapeTimeout bounds the backend calls of one scrape.
const DefaultScrapeTimeout = 5 * time.Second

// Metrics owns the gateway's registry.
type Metrics struct {
	reg      *prometheus.Registry
	log      *slog.Logger
	host     *hostCollector
	guest    *guestCollector
	bounds   *countersCollector[*hypervisorv1.GetBoundCountersResponse]
	suspend  *countersCollector[*hypervisorv1.SuspendCounters]
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
	refused  *prometheus.CounterVec
}

// Source is what the host and guest collectors read at scrape time: the
// hypervisor's internal TelemetryService (no caller token exists during a
// scrape).
type Source = hypervisorv1.TelemetryServiceClient

// New builds the registry: Go and process collectors, build info, the host
// collector over hv and the request metrics. hv may be nil (no host metrics,
// backend_up 0).
func New(hv Source, log *slog.Logger) *Metrics {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		log: log,
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vm_manager_requests_total",
			Help: "Requests served, by surface (rest, grpc, mcp), method and result code.",
		}, []string{"surface", "method", "code"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "vm_manager_request_duration_seconds",
			Help:    "Request latency, by surface (rest, grpc, mcp) and method.",
			Buckets: prometheus.DefBuckets,
		}, []string{"surface", "method"}),
		refused: newRefused(),
	}
	m.host = newHostCollector(hv, log, DefaultScrapeTimeout)
	scrape := hypervisorScrape{hv: hv, log: log, timeout: DefaultScrapeTimeout, errors: m.host.scrapeErrors}
	m.guest = &guestCollector{hypervisorScrape: scrape}
	// What the hypervisor's per-VM and per-host bounds refused or cut.
	m.bounds = newCountersCollector(scrape, "bound counters", boundsDescs, func(ctx context.Context, hv Source) (*hypervisorv1.GetBoundCountersResponse, error) {
		return hv.GetBoundCounters(ctx, &hypervisorv1.GetBoundCountersRequest{})
	}, collectBounds)
	m.suspend = newCountersCollector(scrape, "suspend counters", suspendDescs, func(ctx context.Context, hv Source) (*hypervisorv1.SuspendCounters, error) {
		return hv.GetSuspendCounters(ctx, &hypervisorv1.GetSuspendCountersRequest{})
	}, collectSuspend)
	build := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "vm_manager_build_info",
		Help: "Always 1; the labels say which build serves.",
	}, []string{"version", "commit", "go_version"})
	build.WithLabelValues(buildinfo.Version, buildinfo.CommitOrVCS(), runtime.Version()).Set(1)
	m.reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		build,
		m.host,
		m.guest,
		m.bounds,
		m.suspend,
		m.requests,
		m.duration,
		m.refused,
	)
	return m
}

// Registry is the registry behind Handler, for callers that add their own
// collectors.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler serves the Prometheus exposition of the registry.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{
		ErrorLog:      errorLog{m.log},
		ErrorHandling: promhttp.ContinueOnError,
	})
}

// observe records one request.
func (m *Metrics) observe(surface, method, code string, d time.Duration) {
	m.requests.WithLabelValues(surface, method, code).Inc()
	m.duration.WithLabelValues(surface, method).Observe(d.Seconds())
}

// ObserveMCP records one MCP tool call: code is "ok" or the error code.
func (m *Metrics) ObserveMCP(tool, code string, d time.Duration) {
	if code == "" {
		code = "ok"
	}
	m.observe(SurfaceMCP, tool, code, d)
}

// errorLog adapts slog to promhttp.Logger.
type errorLog struct{ log *slog.Logger }

func (l errorLog) Println(v ...any) {
	l.log.Warn("metrics exposition", "error", fmt.Sprint(v...))
}

// scrapeContext is a fresh context for the backend calls of a scrape: it
// carries none of a caller's metadata.
func scrapeContext(timeout time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), timeout)
}

// hypervisorScrape is what the collectors that ask the hypervisor at scrape
// time (besides the host collector) share: its TelemetryService, the bound
// of a call, and where a failed call is logged and counted.
type hypervisorScrape struct {
	hv      Source
	log     *slog.Logger
	timeout time.Duration
	errors  *prometheus.CounterVec // the host collector's vm_manager_scrape_errors_total
}

// countersCollector exports the answer of one TelemetryService counters
// call (what, as logged) at scrape time: export turns it into descs'
// metrics.
type countersCollector[T any] struct {
	hypervisorScrape
	what   string
	descs  []*prometheus.Desc
	call   func(context.Context, Source) (T, error)
	export func(chan<- prometheus.Metric, T)
}

func newCountersCollector[T any](s hypervisorScrape, what string, descs []*prometheus.Desc, call func(context.Context, Source) (T, error), export func(chan<- prometheus.Metric, T)) *countersCollector[T] {
	return &countersCollector[T]{hypervisorScrape: s, what: what, descs: descs, call: call, export: export}
}

func (c *countersCollector[T]) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.descs {
		ch <- d
	}
}

// Collect exports nothing when the call fails. A failure is counted as the
// hypervisor's scrape error, except Unimplemented: an older hypervisor has
// no such counters.
func (c *countersCollector[T]) Collect(ch chan<- prometheus.Metric) {
	if c.hv == nil {
		return
	}
	ctx, cancel := scrapeContext(c.timeout)
	defer cancel()
	r, err := c.call(ctx, c.hv)
	if err != nil {
		if status.Code(err) != codes.Unimplemented {
			c.errors.WithLabelValues(backendHypervisor).Inc()
		}
		c.log.Debug("metrics: "+c.what, "error", err)
		return
	}
	c.export(ch, r)
}

// exposedKeys are the keys of a counter by key (a reason, a bound) to
// export: known, each exposed from the start, in order, then whatever other
// key counts has (one a newer hypervisor added).
func exposedKeys(known []string, counts map[string]uint64) []string {
	keys := append([]string(nil), known...)
	for k := range counts {
		if !slices.Contains(keys, k) {
			keys = append(keys, k)
		}
	}
	return keys
}

// onePerID is entries without those with no id or with the id of an earlier
// one: a series exported twice would fail the scrape.
func onePerID[T any](entries []T, id func(T) string) []T {
	seen := make(map[string]bool, len(entries))
	out := entries[:0:0]
	for _, e := range entries {
		if k := id(e); k != "" && !seen[k] {
			seen[k] = true
			out = append(out, e)
		}
	}
	return out
}
