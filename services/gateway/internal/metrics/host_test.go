package metrics

import (
	"fmt"
	"math"
	"runtime"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/pkg/buildinfo"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/protobuf/proto"
)

func TestHostCollector(t *testing.T) {
	m, fake, _ := newHost(t)
	f := scrape(t, m)

	f.want(t, 1, "vm_manager_backend_up", "backend", "hypervisor")
	f.want(t, 0, "vm_manager_scrape_errors_total", "backend", "hypervisor")

	// State: one-hot over every state.
	f.wantType(t, "vm_manager_vm_state", dto.MetricType_GAUGE)
	wantStates := []string{"creating", "installing", "booting", "attesting", "ready", "running", "stopping", "stopped", "failed", "deleting", "suspending", "suspended"}
	for _, vm := range []struct{ id, name, state string }{{"aaaa0001", "alpha", "ready"}, {"bbbb0002", "beta", "stopped"}} {
		if got := len(f.find("vm_manager_vm_state", "vm", vm.id)); got != len(wantStates) {
			t.Errorf("vm_manager_vm_state{vm=%s}: %d series, want %d", vm.id, got, len(wantStates))
		}
		for _, st := range wantStates {
			want := 0.0
			if st == vm.state {
				want = 1
			}
			f.want(t, want, "vm_manager_vm_state", "vm", vm.id, "name", vm.name, "state", st)
		}
	}
	// Attestation: one-hot over disabled|pending|released|failed.
	for _, c := range []struct{ id, state string }{{"aaaa0001", "released"}, {"bbbb0002", "disabled"}} {
		if got := len(f.find("vm_manager_vm_attestation", "vm", c.id)); got != 4 {
			t.Errorf("vm_manager_vm_attestation{vm=%s}: %d series, want 4", c.id, got)
		}
		for _, st := range []string{"disabled", "pending", "released", "failed"} {
			want := 0.0
			if st == c.state {
				want = 1
			}
			f.want(t, want, "vm_manager_vm_attestation", "vm", c.id, "state", st)
		}
	}
	// Info.
	info := labelsOf(f.one(t, "vm_manager_vm_info", "vm", "aaaa0001"))
	wantInfo := map[string]string{"vm": "aaaa0001", "name": "alpha", "network": "default", "ip": "192.168.127.2", "image": "flatcar_4230.2.0"}
	if fmt.Sprint(info) != fmt.Sprint(wantInfo) {
		t.Errorf("vm_manager_vm_info labels = %v, want %v", info, wantInfo)
	}
	f.want(t, 1, "vm_manager_vm_info", "vm", "bbbb0002", "ip", "192.168.127.3")

	// Per-VM values.
	f.want(t, float64(t0.Unix()), "vm_manager_vm_created_timestamp_seconds", "vm", "aaaa0001", "name", "alpha")
	f.want(t, float64(t0.Unix()+10), "vm_manager_vm_created_timestamp_seconds", "vm", "bbbb0002", "name", "beta")
	f.want(t, 42, "vm_manager_vm_install_seconds", "vm", "aaaa0001")
	f.want(t, 25, "vm_manager_vm_install_seconds", "vm", "bbbb0002")
	f.want(t, 7, "vm_manager_vm_boot_to_ready_seconds", "vm", "aaaa0001")
	if n := len(f.find("vm_manager_vm_boot_to_ready_seconds", "vm", "bbbb0002")); n != 0 {
		t.Errorf("beta never booted but has %d boot_to_ready series", n)
	}
	f.want(t, 3, "vm_manager_vm_boot_phase_seconds", "vm", "aaaa0001", "phase", "firmware")
	f.want(t, 0.25, "vm_manager_vm_boot_phase_seconds", "vm", "aaaa0001", "phase", "qemu")
	if n := len(f.find("vm_manager_vm_boot_phase_seconds", "vm", "aaaa0001")); n != 7 {
		t.Errorf("alpha has %d boot phase series, want 7", n)
	}
	if n := len(f.find("vm_manager_vm_boot_phase_seconds", "vm", "bbbb0002")); n != 0 {
		t.Errorf("beta never booted but has %d boot phase series", n)
	}
	f.wantType(t, "vm_manager_vm_cpu_seconds_total", dto.MetricType_COUNTER)
	f.want(t, 12.5, "vm_manager_vm_cpu_seconds_total", "vm", "aaaa0001", "name", "alpha")
	if n := len(f.find("vm_manager_vm_cpu_seconds_total", "vm", "bbbb0002")); n != 0 {
		t.Errorf("beta has no process but %d cpu series", n)
	}
	f.want(t, 1<<30, "vm_manager_vm_memory_rss_bytes", "vm", "aaaa0001")
	f.want(t, 5<<30, "vm_manager_vm_disk_bytes", "vm", "aaaa0001")
	f.want(t, 1<<30, "vm_manager_vm_disk_bytes", "vm", "bbbb0002")

	// Counts per state, every state present.
	if got := len(f.find("vm_manager_vms")); got != len(wantStates) {
		t.Errorf("vm_manager_vms: %d series, want %d", got, len(wantStates))
	}
	f.want(t, 1, "vm_manager_vms", "state", "ready")
	f.want(t, 1, "vm_manager_vms", "state", "stopped")
	f.want(t, 0, "vm_manager_vms", "state", "failed")

	// Networks: one series per network and direction, not per VM.
	f.wantType(t, "vm_manager_network_bytes_total", dto.MetricType_COUNTER)
	if got := len(f.find("vm_manager_network_bytes_total")); got != 2 {
		t.Errorf("vm_manager_network_bytes_total: %d series, want 2", got)
	}
	f.want(t, 1000, "vm_manager_network_bytes_total", "network", "default", "direction", "sent")
	f.want(t, 2000, "vm_manager_network_bytes_total", "network", "default", "direction", "received")
	f.want(t, 2, "vm_manager_network_leases", "network", "default")
	f.wantType(t, "vm_manager_network_dropped_frames_total", dto.MetricType_COUNTER)
	f.want(t, 3, "vm_manager_network_dropped_frames_total", "network", "default", "vm", "aaaa0001")
	f.want(t, 0, "vm_manager_network_dropped_frames_total", "network", "default", "vm", "bbbb0002")
	// The VM's network counters, per reason.
	f.wantType(t, "vm_manager_network_egress_dropped_total", dto.MetricType_COUNTER)
	f.want(t, 6, "vm_manager_network_egress_dropped_total", "network", "default", "vm", "aaaa0001", "reason", "rule")
	f.want(t, 3, "vm_manager_network_egress_dropped_total", "network", "default", "vm", "aaaa0001", "reason", "local")
	f.wantType(t, "vm_manager_network_nat_flows", dto.MetricType_GAUGE)
	f.want(t, 4, "vm_manager_network_nat_flows", "vm", "aaaa0001", "protocol", "tcp")
	f.want(t, 3, "vm_manager_network_nat_flows", "vm", "aaaa0001", "protocol", "udp")
	f.want(t, 15, "vm_manager_network_nat_refused_total", "vm", "aaaa0001", "reason", "udp_vm_limit")
	f.want(t, 0, "vm_manager_network_nat_refused_total", "vm", "aaaa0001", "reason", "tcp_vm_limit")
	f.want(t, 3, "vm_manager_network_dns_refused_total", "vm", "aaaa0001", "reason", "policy")
	f.want(t, 1, "vm_manager_network_imds_connections", "vm", "aaaa0001")
	f.want(t, 18, "vm_manager_network_imds_connections_dropped_total", "vm", "aaaa0001", "reason", "limit")
	f.want(t, 3, "vm_manager_network_imds_connections_dropped_total", "vm", "aaaa0001", "reason", "timeout")
	f.want(t, 0, "vm_manager_network_imds_connections_dropped_total", "vm", "bbbb0002", "reason", "timeout")

	// Guest series: per-VM report counts, then the entries as typed families
	// labelled vm, object and their fields.
	if age := f.value(t, "vm_guest_report_age_seconds", "vm", "aaaa0001"); age < 4 || age > 60 {
		t.Errorf("vm_guest_report_age_seconds = %v, want about 4", age)
	}
	f.want(t, 17, "vm_guest_report_series", "vm", "aaaa0001")
	if n := len(f.find("vm_guest_report_age_seconds", "vm", "bbbb0002")); n != 0 {
		t.Errorf("beta sent no report but has %d age series", n)
	}
	f.wantType(t, "vm_guest_reports_total", dto.MetricType_COUNTER)
	f.want(t, 9, "vm_guest_reports_total", "vm", "aaaa0001")
	f.want(t, 0, "vm_guest_reports_total", "vm", "bbbb0002")
	f.wantType(t, "vm_guest_report_series_dropped_total", dto.MetricType_COUNTER)
	for reason, want := range map[string]float64{"limit": 0, "unsupported": 2, "duplicate": 1} {
		f.want(t, want, "vm_guest_report_series_dropped_total", "vm", "aaaa0001", "reason", reason)
		f.want(t, 0, "vm_guest_report_series_dropped_total", "vm", "bbbb0002", "reason", reason)
	}
	f.wantType(t, "vm_guest_io_vmagent_uptime_seconds", dto.MetricType_GAUGE)
	f.want(t, 12.5, "vm_guest_io_vmagent_uptime_seconds", "vm", "aaaa0001", "object", "")
	f.want(t, 0.25, "vm_guest_io_vmagent_load_average", "vm", "aaaa0001", "period", "5m")
	f.wantType(t, "vm_guest_io_vmagent_context_switches_total", dto.MetricType_COUNTER)
	f.want(t, 98765, "vm_guest_io_vmagent_context_switches_total", "vm", "aaaa0001")
	f.wantType(t, "vm_guest_io_vmagent_attestation_info", dto.MetricType_GAUGE)
	f.want(t, 1, "vm_guest_io_vmagent_attestation_info", "vm", "aaaa0001", "object", "initrd", "value", "verified")

	// Build info, Go and process collectors.
	f.want(t, 1, "vm_manager_build_info", "version", buildinfo.Version, "commit", buildinfo.CommitOrVCS(), "go_version", runtime.Version())
	for _, fam := range []string{"go_goroutines", "process_start_time_seconds"} {
		if f[fam] == nil {
			t.Errorf("family %s missing", fam)
		}
	}

	// Histograms: each VM's duration once.
	checkHist := func(f families, name string, wantCount uint64, wantSum float64) {
		t.Helper()
		f.wantType(t, name, dto.MetricType_HISTOGRAM)
		if c, s := f.histogram(t, name); c != wantCount || s != wantSum {
			t.Errorf("%s: count %d sum %v, want %d and %v", name, c, s, wantCount, wantSum)
		}
	}
	checkHist(f, "vm_manager_vm_install_duration_seconds", 2, 67)
	checkHist(f, "vm_manager_vm_boot_to_ready_duration_seconds", 1, 7)
	// The phase histogram: one series per phase, each boot's once.
	checkPhase := func(f families, phase string, wantCount uint64, wantSum float64) {
		t.Helper()
		h := f.find("vm_manager_vm_boot_phase_duration_seconds", "phase", phase)
		if len(h) != 1 || h[0].GetHistogram().GetSampleCount() != wantCount || h[0].GetHistogram().GetSampleSum() != wantSum {
			t.Errorf("boot phase %s: %v, want count %d sum %v", phase, h, wantCount, wantSum)
		}
	}
	checkPhase(f, "firmware", 1, 3)
	checkPhase(f, "provision", 1, 0.5)
	var bounds []float64
	for _, b := range f.one(t, "vm_manager_vm_install_duration_seconds").GetHistogram().GetBucket() {
		if !math.IsInf(b.GetUpperBound(), 1) {
			bounds = append(bounds, b.GetUpperBound())
		}
	}
	if fmt.Sprint(bounds) != fmt.Sprint(installBuckets) {
		t.Errorf("install buckets %v, want %v", bounds, installBuckets)
	}

	// A second scrape observes nothing again.
	f = scrape(t, m)
	checkHist(f, "vm_manager_vm_install_duration_seconds", 2, 67)
	checkHist(f, "vm_manager_vm_boot_to_ready_duration_seconds", 1, 7)
	checkPhase(f, "firmware", 1, 3)

	// A reboot (new booted/ready times) counts once more; beta's delete
	// drops its key.
	fake.mu.Lock()
	fake.vms[0].BootedAt, fake.vms[0].ReadyAt = at(time.Hour), at(time.Hour+9*time.Second)
	fake.metrics["aaaa0001"].Host.BootToReadySeconds = proto.Float64(9)
	fake.vms = fake.vms[:1]
	fake.guests = fake.guests[:1]
	delete(fake.metrics, "bbbb0002")
	fake.mu.Unlock()
	f = scrape(t, m)
	f = scrape(t, m)
	checkHist(f, "vm_manager_vm_install_duration_seconds", 2, 67)
	checkHist(f, "vm_manager_vm_boot_to_ready_duration_seconds", 2, 16)
	checkPhase(f, "firmware", 2, 6)
	f.want(t, 0, "vm_manager_vms", "state", "stopped")
	if n := len(f.find("vm_manager_vm_state", "vm", "bbbb0002")); n != 0 {
		t.Errorf("deleted VM still has %d state series", n)
	}
	if n := len(f.find("vm_guest_reports_total", "vm", "bbbb0002")); n != 0 {
		t.Errorf("deleted VM still has %d guest series", n)
	}
	m.host.mu.Lock()
	if _, ok := m.host.observed["bbbb0002"]; ok || len(m.host.observed) != 1 {
		t.Errorf("observed keys %v, want only aaaa0001", m.host.observed)
	}
	m.host.mu.Unlock()

	fake.mu.Lock()
	defer fake.mu.Unlock()
	if fake.authSeen {
		t.Error("the scrape sent an authorization header")
	}
}

func TestHostCollectorBackendDown(t *testing.T) {
	m, _, stop := newHost(t)
	f := scrape(t, m)
	f.want(t, 1, "vm_manager_backend_up", "backend", "hypervisor")

	stop()
	start := time.Now()
	f = scrape(t, m)
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("scrape with the backend down took %v", d)
	}
	f.want(t, 0, "vm_manager_backend_up", "backend", "hypervisor")
	if v := f.value(t, "vm_manager_scrape_errors_total", "backend", "hypervisor"); v < 1 {
		t.Errorf("vm_manager_scrape_errors_total = %v, want ≥1", v)
	}
	for _, fam := range []string{"vm_manager_vm_state", "vm_manager_vms", "vm_manager_network_leases"} {
		if f[fam] != nil {
			t.Errorf("family %s exposed without a backend", fam)
		}
	}
	// What does not need the backend is still there, histograms included.
	for _, fam := range []string{"vm_manager_build_info", "go_goroutines", "vm_manager_vm_install_duration_seconds"} {
		if f[fam] == nil {
			t.Errorf("family %s missing", fam)
		}
	}
	if c, _ := f.histogram(t, "vm_manager_vm_install_duration_seconds"); c != 2 {
		t.Errorf("install histogram count %d after the backend went away, want 2", c)
	}
}

func TestNilClient(t *testing.T) {
	m := New(nil, nil)
	f := scrape(t, m)
	f.want(t, 0, "vm_manager_backend_up", "backend", "hypervisor")
}
