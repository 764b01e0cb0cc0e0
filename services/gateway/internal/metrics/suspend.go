package metrics

import (
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/prometheus/client_golang/prometheus"
)

// Suspend and resume (issue 19); how many VMs are suspended is
// vm_manager_vms{state="suspended"}.
var (
	descSuspends       = desc("vm_manager_suspends_total", "Suspends of VMs to disk, by result: ok, failed (the VM ran on).", "result")
	descResumes        = desc("vm_manager_resumes_total", "Resumes of suspended VMs, by result: ok, failed (the VM stayed suspended).", "result")
	descSuspendSeconds = desc("vm_manager_suspend_seconds_total", "Time the successful suspends took, summed (divide by vm_manager_suspends_total{result=\"ok\"}).")
	descResumeSeconds  = desc("vm_manager_resume_seconds_total", "Time the successful resumes took until the guest ran, summed (divide by vm_manager_resumes_total{result=\"ok\"}).")
)

// suspendDescs are what collectSuspend exports.
var suspendDescs = []*prometheus.Desc{descSuspends, descResumes, descSuspendSeconds, descResumeSeconds}

// collectSuspend exports TelemetryService.GetSuspendCounters.
func collectSuspend(ch chan<- prometheus.Metric, r *hypervisorv1.SuspendCounters) {
	ch <- counter(descSuspends, float64(r.GetSuspendsTotal()), "ok")
	ch <- counter(descSuspends, float64(r.GetSuspendFailuresTotal()), "failed")
	ch <- counter(descResumes, float64(r.GetResumesTotal()), "ok")
	ch <- counter(descResumes, float64(r.GetResumeFailuresTotal()), "failed")
	ch <- counter(descSuspendSeconds, r.GetSuspendSecondsTotal())
	ch <- counter(descResumeSeconds, r.GetResumeSecondsTotal())
}
