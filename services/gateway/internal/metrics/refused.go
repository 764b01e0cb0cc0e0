package metrics

import (
	"github.com/giantswarm/vm-manager/services/gateway/internal/xsite"
	"github.com/prometheus/client_golang/prometheus"
)

// Refusal reasons and surfaces of vm_manager_requests_refused_total that
// exist from the start (at 0), so a rate() sees the first one.
var (
	refusedSurfaces = []string{SurfaceREST, SurfaceMCP}
	refusedReasons  = []string{xsite.ReasonContentType, xsite.ReasonHost, xsite.ReasonOrigin}
)

func newRefused() *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vm_manager_requests_refused_total",
		Help: "HTTP requests refused before any handler ran because a web page could have sent them, by surface (rest, mcp) and reason (content_type: a body not sent as application/json; host, origin: not this gateway's, on the anonymous API).",
	}, []string{"surface", "reason"})
	for _, s := range refusedSurfaces {
		for _, r := range refusedReasons {
			c.WithLabelValues(s, r)
		}
	}
	return c
}

// Refused counts one refused request; a nil Metrics counts nothing.
func (m *Metrics) Refused(surface, reason string) {
	if m == nil {
		return
	}
	m.refused.WithLabelValues(surface, reason).Inc()
}
