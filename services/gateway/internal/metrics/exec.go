package metrics

import (
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/prometheus/client_golang/prometheus"
)

var (
	descExecOpen    = desc("vm_manager_exec_sessions", "Streamed exec sessions open now.")
	descExecStarted = desc("vm_manager_exec_sessions_started_total", "Streamed exec sessions that started.")
	descExecRefused = desc("vm_manager_exec_sessions_refused_total", "Streamed exec sessions refused at the host's bound (--max-exec-sessions).")
	descExecEnded   = desc("vm_manager_exec_sessions_ended_total", "Streamed exec sessions ended, by reason: exit, client, idle_timeout (--exec-idle-timeout), max_duration (--exec-max-duration), shutdown, error.", "reason")
)

// execReasons are vm_manager_exec_sessions_ended_total's reasons, each
// exposed from the start.
var execReasons = []string{"exit", "client", "idle_timeout", "max_duration", "shutdown", "error"}

var execDescs = []*prometheus.Desc{descExecOpen, descExecStarted, descExecRefused, descExecEnded}

// collectExec exports the exec session counters; a hypervisor without them
// exports nothing.
func collectExec(ch chan<- prometheus.Metric, e *hypervisorv1.ExecSessionCounters) {
	if e == nil {
		return
	}
	ch <- prometheus.MustNewConstMetric(descExecOpen, prometheus.GaugeValue, float64(e.GetOpen()))
	ch <- counter(descExecStarted, float64(e.GetStartedTotal()))
	ch <- counter(descExecRefused, float64(e.GetRefusedTotal()))
	ended := e.GetEndedTotal()
	for _, r := range exposedKeys(execReasons, ended) {
		ch <- counter(descExecEnded, float64(ended[r]), r)
	}
}
