package metrics

import (
	"context"
	"log/slog"
	"time"

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

// suspendCollector exports TelemetryService.GetSuspendCounters at scrape time.
type suspendCollector struct {
	hv      Source
	log     *slog.Logger
	timeout time.Duration
	errors  *prometheus.CounterVec
}

func (c *suspendCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descSuspends, descResumes, descSuspendSeconds, descResumeSeconds} {
		ch <- d
	}
}

func (c *suspendCollector) Collect(ch chan<- prometheus.Metric) {
	if c.hv == nil {
		return
	}
	r, ok := optionalCounters(c.timeout, c.errors, c.log, "suspend counters", func(ctx context.Context) (*hypervisorv1.SuspendCounters, error) {
		return c.hv.GetSuspendCounters(ctx, &hypervisorv1.GetSuspendCountersRequest{})
	})
	if !ok {
		return
	}
	ch <- counter(descSuspends, float64(r.GetSuspendsTotal()), "ok")
	ch <- counter(descSuspends, float64(r.GetSuspendFailuresTotal()), "failed")
	ch <- counter(descResumes, float64(r.GetResumesTotal()), "ok")
	ch <- counter(descResumes, float64(r.GetResumeFailuresTotal()), "failed")
	ch <- counter(descSuspendSeconds, r.GetSuspendSecondsTotal())
	ch <- counter(descResumeSeconds, r.GetResumeSecondsTotal())
}
