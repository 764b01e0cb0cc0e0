package metrics

import (
	"context"
	"log/slog"
	"slices"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/prometheus/client_golang/prometheus"
)

var (
	descIMDSLimited   = desc("vm_manager_imds_requests_limited_total", "IMDS requests of the VM answered 429 (over --imds-requests-per-second and --imds-request-burst).", "vm")
	descIMDSTooLarge  = desc("vm_manager_imds_bodies_too_large_total", "IMDS bodies of the VM answered 413, by body: quote (--imds-max-quote-bytes), report (--imds-max-report-bytes).", "vm", "body")
	descConsoleRot    = desc("vm_manager_vm_console_rotations_total", "Rotations of the VM's serial console into console.log.1 (--console-log-max-bytes).", "vm")
	descConsoleMoved  = desc("vm_manager_vm_console_rotated_bytes_total", "Bytes the rotations moved out of the VM's console.log.", "vm")
	descConsoleDrop   = desc("vm_manager_vm_console_dropped_bytes_total", "Bytes of the VM's serial console no longer kept on disk.", "vm")
	descLimitRefusals = desc("vm_manager_limit_refusals_total", "Creates refused at a per-host bound (resource_exhausted), by bound: vms, networks, forwards_per_vm; watch streams refused (watchers: --max-watchers) or cut off for falling behind (watch_buffer: --watch-buffer).", "limit")
)

// limitNames are vm_manager_limit_refusals_total's bounds, each exposed
// from the start.
var limitNames = []string{"vms", "networks", "forwards_per_vm", "watchers", "watch_buffer"}

// boundsCollector exports what the hypervisor's per-VM and per-host bounds
// refused or cut (TelemetryService.GetBoundCounters) at scrape time.
type boundsCollector struct {
	hv      Source
	log     *slog.Logger
	timeout time.Duration
	errors  *prometheus.CounterVec // the host collector's vm_manager_scrape_errors_total
}

func (c *boundsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range append([]*prometheus.Desc{descIMDSLimited, descIMDSTooLarge, descConsoleRot, descConsoleMoved, descConsoleDrop, descLimitRefusals, descLifetimeActs}, execDescs...) {
		ch <- d
	}
}

func (c *boundsCollector) Collect(ch chan<- prometheus.Metric) {
	if c.hv == nil {
		return
	}
	r, ok := optionalCounters(c.timeout, c.errors, c.log, "bound counters", func(ctx context.Context) (*hypervisorv1.GetBoundCountersResponse, error) {
		return c.hv.GetBoundCounters(ctx, &hypervisorv1.GetBoundCountersRequest{})
	})
	if !ok {
		return
	}
	seen := map[string]bool{}
	for _, vm := range r.GetVms() {
		id := vm.GetVmId()
		if id == "" || seen[id] {
			continue
		}
		seen[id] = true
		ch <- counter(descIMDSLimited, float64(vm.GetImdsRateLimitedTotal()), id)
		for _, body := range []string{"quote", "report"} {
			ch <- counter(descIMDSTooLarge, float64(vm.GetImdsBodyTooLargeTotal()[body]), id, body)
		}
		ch <- counter(descConsoleRot, float64(vm.GetConsoleRotationsTotal()), id)
		ch <- counter(descConsoleMoved, float64(vm.GetConsoleRotatedBytesTotal()), id)
		ch <- counter(descConsoleDrop, float64(vm.GetConsoleDroppedBytesTotal()), id)
	}
	collectLifetimeActions(ch, r.GetLifetimeActionsTotal())
	refused := r.GetRefusedTotal()
	names := append([]string(nil), limitNames...)
	for name := range refused {
		if !slices.Contains(names, name) {
			names = append(names, name)
		}
	}
	for _, name := range names {
		ch <- counter(descLimitRefusals, float64(refused[name]), name)
	}
	collectExec(ch, r.GetExecSessions())
}
