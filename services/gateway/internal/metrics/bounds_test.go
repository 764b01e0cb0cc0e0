package metrics

import (
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	dto "github.com/prometheus/client_model/go"
)

func TestBoundCounters(t *testing.T) {
	m, fake, _ := newHost(t)
	// An older hypervisor without the RPC: no families, no scrape error.
	f := scrape(t, m)
	if len(f.find("vm_manager_limit_refusals_total")) != 0 {
		t.Error("bound counters without the RPC")
	}
	f.want(t, 0, "vm_manager_scrape_errors_total", "backend", "hypervisor")

	fake.mu.Lock()
	fake.bounds = &hypervisorv1.GetBoundCountersResponse{
		RefusedTotal: map[string]uint64{"vms": 3},
		Vms: []*hypervisorv1.VirtualMachineBoundCounters{
			{VmId: "aaaa0001", ImdsRateLimitedTotal: 120, ImdsBodyTooLargeTotal: map[string]uint64{"quote": 2},
				ConsoleRotationsTotal: 4, ConsoleRotatedBytesTotal: 1 << 20, ConsoleDroppedBytesTotal: 3 << 19},
			{VmId: "bbbb0002"},
		},
	}
	fake.mu.Unlock()
	f = scrape(t, m)
	f.wantType(t, "vm_manager_imds_requests_limited_total", dto.MetricType_COUNTER)
	f.want(t, 120, "vm_manager_imds_requests_limited_total", "vm", "aaaa0001")
	f.want(t, 0, "vm_manager_imds_requests_limited_total", "vm", "bbbb0002")
	f.want(t, 2, "vm_manager_imds_bodies_too_large_total", "vm", "aaaa0001", "body", "quote")
	f.want(t, 0, "vm_manager_imds_bodies_too_large_total", "vm", "aaaa0001", "body", "report")
	f.want(t, 4, "vm_manager_vm_console_rotations_total", "vm", "aaaa0001")
	f.want(t, 1<<20, "vm_manager_vm_console_rotated_bytes_total", "vm", "aaaa0001")
	f.want(t, 3<<19, "vm_manager_vm_console_dropped_bytes_total", "vm", "aaaa0001")
	f.want(t, 3, "vm_manager_limit_refusals_total", "limit", "vms")
	f.want(t, 0, "vm_manager_limit_refusals_total", "limit", "networks")
	f.want(t, 0, "vm_manager_limit_refusals_total", "limit", "forwards_per_vm")
}

func TestExecSessionCounters(t *testing.T) {
	m, fake, _ := newHost(t)
	fake.mu.Lock()
	fake.bounds = &hypervisorv1.GetBoundCountersResponse{ExecSessions: &hypervisorv1.ExecSessionCounters{
		Open: 2, StartedTotal: 9, RefusedTotal: 1, EndedTotal: map[string]uint64{"exit": 5, "idle_timeout": 2},
	}}
	fake.mu.Unlock()
	f := scrape(t, m)
	f.wantType(t, "vm_manager_exec_sessions", dto.MetricType_GAUGE)
	f.want(t, 2, "vm_manager_exec_sessions")
	f.want(t, 9, "vm_manager_exec_sessions_started_total")
	f.want(t, 1, "vm_manager_exec_sessions_refused_total")
	f.want(t, 5, "vm_manager_exec_sessions_ended_total", "reason", "exit")
	f.want(t, 2, "vm_manager_exec_sessions_ended_total", "reason", "idle_timeout")
	f.want(t, 0, "vm_manager_exec_sessions_ended_total", "reason", "max_duration")
}
