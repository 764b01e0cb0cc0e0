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
	bounds   *boundsCollector
	suspend  *suspendCollector
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
	m.guest = &guestCollector{hv: hv, log: log, timeout: DefaultScrapeTimeout, errors: m.host.scrapeErrors}
	m.bounds = &boundsCollector{hv: hv, log: log, timeout: DefaultScrapeTimeout, errors: m.host.scrapeErrors}
	m.suspend = &suspendCollector{hv: hv, log: log, timeout: DefaultScrapeTimeout, errors: m.host.scrapeErrors}
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

// optionalCounters calls a TelemetryService method for a scrape. A failure
// is counted as the hypervisor's scrape error, except Unimplemented: an
// older hypervisor has no such counters.
func optionalCounters[T any](timeout time.Duration, errs *prometheus.CounterVec, log *slog.Logger, what string, call func(context.Context) (T, error)) (T, bool) {
	ctx, cancel := scrapeContext(timeout)
	defer cancel()
	r, err := call(ctx)
	if err != nil {
		if status.Code(err) != codes.Unimplemented {
			errs.WithLabelValues(backendHypervisor).Inc()
		}
		log.Debug("metrics: "+what, "error", err)
		return r, false
	}
	return r, true
}
