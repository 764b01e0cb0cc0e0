package metrics

import (
	"testing"

	dto "github.com/prometheus/client_model/go"
)

func TestRefused(t *testing.T) {
	m := New(nil, nil)
	f := scrape(t, m)
	f.wantType(t, "vm_manager_requests_refused_total", dto.MetricType_COUNTER)
	if n := len(f["vm_manager_requests_refused_total"].GetMetric()); n != 6 {
		t.Errorf("%d refusal series before any refusal, want 6 at 0", n)
	}
	m.Refused(SurfaceREST, "host")
	m.Refused(SurfaceREST, "host")
	m.Refused(SurfaceMCP, "content_type")
	(*Metrics)(nil).Refused(SurfaceREST, "origin") // metrics off: nothing, no panic
	f = scrape(t, m)
	f.want(t, 2, "vm_manager_requests_refused_total", "surface", "rest", "reason", "host")
	f.want(t, 0, "vm_manager_requests_refused_total", "surface", "rest", "reason", "origin")
	f.want(t, 1, "vm_manager_requests_refused_total", "surface", "mcp", "reason", "content_type")
}
