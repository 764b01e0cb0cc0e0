package metrics

import (
	"strings"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/prometheus/client_golang/prometheus"
)

// Lifetimes (docs/api.md "Lifetimes").
var (
	descVMExpire      = desc("vm_manager_vm_expire_timestamp_seconds", "When the VM's lifetime expires (on_expire is carried out), in seconds since the epoch; absent without an expiry.", "vm", "name", "on_expire")
	descVMIdleTimeout = desc("vm_manager_vm_idle_timeout_seconds", "The VM's idle_timeout; absent without one.", "vm", "name", "on_idle")
	descVMIdle        = desc("vm_manager_vm_idle_seconds", "Seconds since the VM's last exec, forward or IMDS activity (or its readiness), while it is ready or running with an idle_timeout.", "vm", "name")
	descLifetimeActs  = desc("vm_manager_vm_lifetime_actions_total", "VMs stopped, deleted or suspended by their lifetime since the hypervisor started, by reason (expired, idle) and action (stop, delete, suspend).", "reason", "action")
)

var lifetimeDescs = []*prometheus.Desc{descVMExpire, descVMIdleTimeout, descVMIdle}

// lifetimeActionKeys are lifetime_actions_total's keys, each exposed from the start.
var lifetimeActionKeys = []string{"expired_stop", "expired_delete", "idle_stop", "idle_suspend"}

// collectLifetime exports one VM's lifetime.
func collectLifetime(ch chan<- prometheus.Metric, vm *hypervisorv1.VirtualMachine, now time.Time) {
	lt := vm.GetLifetime()
	if lt == nil {
		return
	}
	id, name := vm.GetId(), vm.GetName()
	if at := lt.GetExpireAt(); at != nil {
		ch <- gauge(descVMExpire, seconds(at), id, name, strings.TrimPrefix(strings.ToLower(lt.GetOnExpire().String()), "on_expire_"))
	}
	idle, err := time.ParseDuration(lt.GetIdleTimeout())
	if err != nil || idle <= 0 {
		return
	}
	ch <- gauge(descVMIdleTimeout, idle.Seconds(), id, name, strings.TrimPrefix(strings.ToLower(lt.GetOnIdle().String()), "on_idle_"))
	switch vm.GetState() {
	case hypervisorv1.State_STATE_READY, hypervisorv1.State_STATE_RUNNING:
	default:
		return
	}
	since := lt.GetLastActivityAt().AsTime()
	if r := vm.GetReadyAt(); r != nil && r.AsTime().After(since) {
		since = r.AsTime()
	}
	ch <- gauge(descVMIdle, max(now.Sub(since).Seconds(), 0), id, name)
}

// collectLifetimeActions exports lifetime_actions_total.
func collectLifetimeActions(ch chan<- prometheus.Metric, acts map[string]uint64) {
	for _, k := range exposedKeys(lifetimeActionKeys, acts) {
		reason, action, ok := strings.Cut(k, "_")
		if !ok {
			continue
		}
		ch <- counter(descLifetimeActs, float64(acts[k]), reason, action)
	}
}
