package metrics

import (
	"slices"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/prometheus/client_golang/prometheus"
)

// guestPrefix starts every guest family (contract §10).
const guestPrefix = "vm_guest_"

// guestHelp is the help of every guest family: one text, because a family
// may come from several guests and the exposition allows only one.
const guestHelp = "An entry of the guests' systemd-report uploads (contract §10); the whole upload is at GET /api/v1/vms/{vm}/report."

// guestReasons are vm_guest_report_series_dropped_total's reasons, each
// exposed from the start.
var guestReasons = []string{"limit", "unsupported", "duplicate"}

var (
	descGuestAge     = desc("vm_guest_report_age_seconds", "Age of the guest's last systemd-report upload.", "vm")
	descGuestSeries  = desc("vm_guest_report_series", "Entries in the guest's last systemd-report upload.", "vm")
	descGuestReports = desc("vm_guest_reports_total", "systemd-report uploads received from the guest since the hypervisor started.", "vm")
	descGuestDropped = desc("vm_guest_report_series_dropped_total", "Entries of the guest's uploads not exported: beyond --metrics-guest-series-limit (limit), not exportable as they are (unsupported), or repeated (duplicate).", "vm", "reason")
)

// guestCollector exports the guests' report entries as vm_guest_<family>
// from the hypervisor's TelemetryService.ListGuestSeries at scrape time. The
// hypervisor names and types them; the families are the guests', so this
// collector describes none (an unchecked collector) and keeps the exposition
// consistent itself: a name another guest already exports with another type
// is left out.
type guestCollector struct {
	hypervisorScrape
}

func (c *guestCollector) Describe(chan<- *prometheus.Desc) {}

func (c *guestCollector) Collect(ch chan<- prometheus.Metric) {
	if c.hv == nil {
		return
	}
	ctx, cancel := scrapeContext(c.timeout)
	defer cancel()
	r, err := c.hv.ListGuestSeries(ctx, &hypervisorv1.ListGuestSeriesRequest{})
	if err != nil {
		// vm_manager_backend_up says the hypervisor is down; a failure of
		// this call alone shows in the error count.
		c.errors.WithLabelValues(backendHypervisor).Inc()
		c.log.Debug("metrics: guest series", "error", err)
		return
	}
	now := time.Now()
	types := map[string]hypervisorv1.GuestSeriesType{}
	for _, vm := range onePerID(r.GetVms(), (*hypervisorv1.VirtualMachineGuestSeries).GetVmId) {
		id := vm.GetVmId()
		ch <- counter(descGuestReports, float64(vm.GetReportsTotal()), id)
		for _, reason := range guestReasons {
			ch <- counter(descGuestDropped, float64(vm.GetSeriesDroppedTotal()[reason]), id, reason)
		}
		if ts := vm.GetReceivedAt(); ts != nil {
			ch <- gauge(descGuestAge, now.Sub(ts.AsTime()).Seconds(), id)
			ch <- gauge(descGuestSeries, float64(vm.GetEntries()), id)
		}
		for _, s := range vm.GetSeries() {
			name := guestPrefix + s.GetName()
			if t, ok := types[name]; ok && t != s.GetType() {
				c.log.Debug("metrics: guest family exported with another type by another vm; left out", "vm", id, "family", name)
				continue
			}
			types[name] = s.GetType()
			ch <- guestMetric(name, id, s)
		}
	}
}

// guestMetric is one series: labels vm, object, the entry's fields and, for
// an info series, value.
func guestMetric(name, vm string, s *hypervisorv1.GuestSeries) prometheus.Metric {
	names := []string{"vm", "object"}
	fields := make([]string, 0, len(s.GetLabels()))
	for k := range s.GetLabels() {
		fields = append(fields, k)
	}
	slices.Sort(fields)
	values := []string{vm, s.GetObject()}
	for _, k := range fields {
		names = append(names, k)
		values = append(values, s.GetLabels()[k])
	}
	vt := prometheus.GaugeValue
	switch s.GetType() {
	case hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_COUNTER:
		vt = prometheus.CounterValue
	case hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_INFO:
		names = append(names, "value")
		values = append(values, s.GetInfo())
	}
	return constMetric(prometheus.NewDesc(name, guestHelp, names, nil), vt, s.GetValue(), values...)
}
