package metrics

import (
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/prometheus/client_golang/prometheus"
)

// bootPhaseBuckets cover a phase from milliseconds (swtpm) to a slow
// firmware under TCG.
var bootPhaseBuckets = []float64{0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30}

var descVMBootPhase = desc("vm_manager_vm_boot_phase_seconds",
	"Seconds of each phase of the last installed boot's launch: provision, register, swtpm, qemu (host), firmware, kernel, agent (guest; from READY=1 on).",
	"vm", "name", "phase")

// bootPhases are a BootPhases' phases by label, those that are set.
func bootPhases(p *hypervisorv1.BootPhases) []struct {
	name string
	v    float64
} {
	if p == nil {
		return nil
	}
	type phase = struct {
		name string
		v    float64
	}
	out := []phase{
		{"provision", p.GetProvisionSeconds()},
		{"register", p.GetRegisterSeconds()},
		{"swtpm", p.GetSwtpmSeconds()},
		{"qemu", p.GetQemuSeconds()},
	}
	for _, g := range []struct {
		name string
		v    *float64
	}{{"firmware", p.FirmwareSeconds}, {"kernel", p.KernelSeconds}, {"agent", p.AgentSeconds}} {
		if g.v != nil {
			out = append(out, phase{g.name, *g.v})
		}
	}
	return out
}

func newBootPhaseHistogram() *prometheus.HistogramVec {
	return prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "vm_manager_vm_boot_phase_duration_seconds",
		Help:    "Durations of the phases of installed boots that reached READY=1, each boot's once.",
		Buckets: bootPhaseBuckets,
	}, []string{"phase"})
}

// collectBootPhases exports a VM's last boot's phases.
func collectBootPhases(ch chan<- prometheus.Metric, h *hypervisorv1.HostMetrics, id, name string) {
	for _, p := range bootPhases(h.GetBootPhases()) {
		ch <- gauge(descVMBootPhase, p.v, id, name, p.name)
	}
}

// observeBootPhases puts a boot's phases into the histogram once, when
// READY=1 has completed them (total set); key is the boot's.
func (c *hostCollector) observeBootPhases(h *hypervisorv1.HostMetrics, key string, keys *observedKeys) {
	p := h.GetBootPhases()
	if p.TotalSeconds == nil || keys.bootPhases == key {
		return
	}
	for _, ph := range bootPhases(p) {
		c.bootPhases.WithLabelValues(ph.name).Observe(ph.v)
	}
	keys.bootPhases = key
}
