package metrics

import (
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
var limitNames = []string{"vms", "networks", "forwards_per_vm", "watchers", "watch_buffer", "image_bytes", "image_store"}

// boundsDescs are what collectBounds exports.
var boundsDescs = append([]*prometheus.Desc{descIMDSLimited, descIMDSTooLarge, descConsoleRot, descConsoleMoved, descConsoleDrop, descLimitRefusals, descLifetimeActs}, execDescs...)

// collectBounds exports what the hypervisor's per-VM and per-host bounds
// refused or cut (TelemetryService.GetBoundCounters).
func collectBounds(ch chan<- prometheus.Metric, r *hypervisorv1.GetBoundCountersResponse) {
	for _, vm := range onePerID(r.GetVms(), (*hypervisorv1.VirtualMachineBoundCounters).GetVmId) {
		id := vm.GetVmId()
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
	for _, name := range exposedKeys(limitNames, refused) {
		ch <- counter(descLimitRefusals, float64(refused[name]), name)
	}
	collectExec(ch, r.GetExecSessions())
}
