package metrics

import (
	"context"
	"log/slog"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Warm pools (docs/metrics.md "Warm pools"), per pool from ListPools at
// scrape time.
var (
	descPoolSize           = desc("vm_manager_pool_size", "Members the warm pool keeps ready (its size).", "pool")
	descPoolReady          = desc("vm_manager_pool_ready", "Members suspended and waiting for a claim.", "pool")
	descPoolFilling        = desc("vm_manager_pool_filling", "Members being booted, attested or suspended (refills under way).", "pool")
	descPoolHits           = desc("vm_manager_pool_hits_total", "Creates of the pool's shape that claimed a ready member.", "pool")
	descPoolMisses         = desc("vm_manager_pool_misses_total", "Creates of the pool's shape that found no ready member and booted cold.", "pool")
	descPoolRefills        = desc("vm_manager_pool_refills_total", "Refills that ended with a ready member.", "pool")
	descPoolRefillFailures = desc("vm_manager_pool_refill_failures_total", "Refills that failed (the pool's lastError says why).", "pool")
	descPoolRefillSeconds  = desc("vm_manager_pool_refill_seconds_total", "Time the successful refills took, summed (divide by vm_manager_pool_refills_total).", "pool")
	descPoolDisk           = desc("vm_manager_pool_disk_bytes", "Space the pool's members take on the host (disk, vTPM, saved RAM).", "pool")
)

var poolDescs = []*prometheus.Desc{descPoolSize, descPoolReady, descPoolFilling, descPoolHits, descPoolMisses,
	descPoolRefills, descPoolRefillFailures, descPoolRefillSeconds, descPoolDisk}

// PoolSource is what the pool series are read from (the TelemetryService).
type PoolSource interface {
	ListPools(ctx context.Context, in *hypervisorv1.ListPoolsRequest, opts ...grpc.CallOption) (*hypervisorv1.ListPoolsResponse, error)
}

// AddPools exports the warm pools of src, read at scrape time; nil (a
// fleet gateway: each node's gateway has its pools) exports none.
func (m *Metrics) AddPools(src PoolSource) {
	if src == nil {
		return
	}
	m.reg.MustRegister(&poolCollector{src: src, log: m.log, timeout: DefaultScrapeTimeout, errors: m.host.scrapeErrors})
}

type poolCollector struct {
	src     PoolSource
	log     *slog.Logger
	timeout time.Duration
	errors  *prometheus.CounterVec // vm_manager_scrape_errors_total
}

func (c *poolCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range poolDescs {
		ch <- d
	}
}

// Collect exports nothing when the call fails. Unimplemented (a hypervisor
// without pools) and Unauthenticated (HypervisorService behind an issuer:
// a scrape has no caller token) are no scrape errors: the series are just
// not there.
func (c *poolCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := scrapeContext(c.timeout)
	defer cancel()
	r, err := c.src.ListPools(ctx, &hypervisorv1.ListPoolsRequest{})
	if err != nil {
		switch status.Code(err) {
		case codes.Unimplemented, codes.Unauthenticated:
		default:
			c.errors.WithLabelValues(backendHypervisor).Inc()
		}
		c.log.Debug("metrics: pools", "error", err)
		return
	}
	for _, p := range onePerID(r.GetPools(), (*hypervisorv1.Pool).GetName) {
		name, st := p.GetName(), p.GetStatus()
		ch <- gauge(descPoolSize, float64(p.GetSize()), name)
		ch <- gauge(descPoolReady, float64(st.GetReady()), name)
		ch <- gauge(descPoolFilling, float64(st.GetFilling()), name)
		ch <- counter(descPoolHits, float64(st.GetHitsTotal()), name)
		ch <- counter(descPoolMisses, float64(st.GetMissesTotal()), name)
		ch <- counter(descPoolRefills, float64(st.GetRefillsTotal()), name)
		ch <- counter(descPoolRefillFailures, float64(st.GetRefillFailuresTotal()), name)
		ch <- counter(descPoolRefillSeconds, st.GetRefillSecondsTotal(), name)
		ch <- gauge(descPoolDisk, float64(st.GetDiskBytes()), name)
	}
}
