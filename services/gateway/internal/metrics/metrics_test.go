package metrics

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/buildinfo"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// fakeHV is a hypervisor's TelemetryService with settable VMs, metrics,
// networks and guest series.
type fakeHV struct {
	hypervisorv1.UnimplementedTelemetryServiceServer

	mu       sync.Mutex
	vms      []*hypervisorv1.VirtualMachine
	metrics  map[string]*hypervisorv1.VirtualMachineMetrics
	networks []*hypervisorv1.Network
	guests   []*hypervisorv1.VirtualMachineGuestSeries
	// authSeen records whether any call carried an authorization header.
	authSeen bool
}

func (f *fakeHV) noteAuth(ctx context.Context) {
	md, _ := metadata.FromIncomingContext(ctx)
	if len(md.Get("authorization")) > 0 {
		f.mu.Lock()
		f.authSeen = true
		f.mu.Unlock()
	}
}

func (f *fakeHV) ListVirtualMachines(ctx context.Context, _ *hypervisorv1.ListVirtualMachinesRequest) (*hypervisorv1.ListVirtualMachinesResponse, error) {
	f.noteAuth(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	out := &hypervisorv1.ListVirtualMachinesResponse{}
	for _, vm := range f.vms {
		out.Vms = append(out.Vms, proto.Clone(vm).(*hypervisorv1.VirtualMachine))
	}
	return out, nil
}

func (f *fakeHV) GetVirtualMachineMetrics(ctx context.Context, r *hypervisorv1.GetVirtualMachineMetricsRequest) (*hypervisorv1.VirtualMachineMetrics, error) {
	f.noteAuth(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	m, ok := f.metrics[r.GetId()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "vm %s not found", r.GetId())
	}
	return proto.Clone(m).(*hypervisorv1.VirtualMachineMetrics), nil
}

func (f *fakeHV) ListNetworks(ctx context.Context, _ *hypervisorv1.ListNetworksRequest) (*hypervisorv1.ListNetworksResponse, error) {
	f.noteAuth(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	out := &hypervisorv1.ListNetworksResponse{}
	for _, n := range f.networks {
		out.Networks = append(out.Networks, proto.Clone(n).(*hypervisorv1.Network))
	}
	return out, nil
}

func (f *fakeHV) ListGuestSeries(ctx context.Context, _ *hypervisorv1.ListGuestSeriesRequest) (*hypervisorv1.ListGuestSeriesResponse, error) {
	f.noteAuth(ctx)
	f.mu.Lock()
	defer f.mu.Unlock()
	out := &hypervisorv1.ListGuestSeriesResponse{}
	for _, g := range f.guests {
		out.Vms = append(out.Vms, proto.Clone(g).(*hypervisorv1.VirtualMachineGuestSeries))
	}
	return out, nil
}

var t0 = time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)

func at(d time.Duration) *timestamppb.Timestamp { return timestamppb.New(t0.Add(d)) }

// newFake has two VMs, alpha (ready, attestation released, with a guest
// report) and beta (stopped, attestation disabled, no process), on network
// "default".
func newFake() *fakeHV {
	net := func(dropped int64) *hypervisorv1.NetworkMetrics {
		return &hypervisorv1.NetworkMetrics{Name: "default", BytesSent: 1000, BytesReceived: 2000, Leases: 2, DroppedFrames: dropped}
	}
	return &fakeHV{
		vms: []*hypervisorv1.VirtualMachine{
			{
				Id: "aaaa0001", Name: "alpha", Image: "flatcar_4230.2.0", Network: "default", Ip: "192.168.127.2",
				State: hypervisorv1.State_STATE_READY, RequireAttestation: true,
				Attestation: &attestationv1.Attestation{Required: true, UserDataReleased: true},
				CreatedAt:   at(0), InstalledAt: at(42 * time.Second), BootedAt: at(50 * time.Second), ReadyAt: at(57 * time.Second),
			},
			{
				Id: "bbbb0002", Name: "beta", Image: "flatcar_4230.2.0", Network: "default", Ip: "192.168.127.3",
				State:     hypervisorv1.State_STATE_STOPPED,
				CreatedAt: at(10 * time.Second), InstalledAt: at(35 * time.Second),
			},
		},
		metrics: map[string]*hypervisorv1.VirtualMachineMetrics{
			"aaaa0001": {Id: "aaaa0001", Host: &hypervisorv1.HostMetrics{
				State: hypervisorv1.State_STATE_READY, Attestation: hypervisorv1.AttestationState_ATTESTATION_STATE_RELEASED,
				Pid: proto.Int32(4242), CpuSeconds: proto.Float64(12.5), MemoryRssBytes: proto.Int64(1 << 30), DiskBytes: 5 << 30,
				InstallSeconds: proto.Float64(42), BootToReadySeconds: proto.Float64(7), Network: net(3),
			}, Guest: &hypervisorv1.GuestMetrics{ReportAgeSeconds: 4.5, Series: 17}},
			"bbbb0002": {Id: "bbbb0002", Host: &hypervisorv1.HostMetrics{
				State: hypervisorv1.State_STATE_STOPPED, Attestation: hypervisorv1.AttestationState_ATTESTATION_STATE_DISABLED,
				DiskBytes: 1 << 30, InstallSeconds: proto.Float64(25), Network: net(0),
			}},
		},
		guests: []*hypervisorv1.VirtualMachineGuestSeries{
			{VmId: "aaaa0001", ReceivedAt: timestamppb.New(time.Now().Add(-4 * time.Second)), ReportsTotal: 9, Entries: 17,
				SeriesDroppedTotal: map[string]uint64{"unsupported": 2, "duplicate": 1},
				Series: []*hypervisorv1.GuestSeries{
					{Name: "io_vmagent_uptime_seconds", Type: hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_GAUGE, Value: 12.5},
					{Name: "io_vmagent_load_average", Type: hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_GAUGE, Labels: map[string]string{"period": "1m"}, Value: 0.5},
					{Name: "io_vmagent_load_average", Type: hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_GAUGE, Labels: map[string]string{"period": "5m"}, Value: 0.25},
					{Name: "io_vmagent_context_switches_total", Type: hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_COUNTER, Value: 98765},
					{Name: "io_vmagent_attestation_info", Type: hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_INFO, Object: "initrd", Value: 1, Info: "verified"},
				}},
			{VmId: "bbbb0002"}, // no upload yet
		},
		networks: []*hypervisorv1.Network{{
			Spec: &hypervisorv1.NetworkSpec{Name: "default", Cidr: "192.168.127.0/24"},
			Leases: []*hypervisorv1.Lease{
				{VmId: "aaaa0001", Ip: "192.168.127.2"},
				{VmId: "bbbb0002", Ip: "192.168.127.3"},
			},
		}},
	}
}

// serve runs srv on a bufconn listener and returns a client connection;
// stop stops the server.
func serve(t *testing.T, srv *grpc.Server) (conn *grpc.ClientConn, stop func()) {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	go func() { _ = srv.Serve(lis) }()
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	stop = func() { once.Do(func() { srv.Stop(); _ = lis.Close() }) }
	t.Cleanup(func() { _ = conn.Close(); stop() })
	return conn, stop
}

func newHost(t *testing.T) (*Metrics, *fakeHV, func()) {
	t.Helper()
	fake := newFake()
	srv := grpc.NewServer()
	hypervisorv1.RegisterTelemetryServiceServer(srv, fake)
	conn, stop := serve(t, srv)
	m := New(hypervisorv1.NewTelemetryServiceClient(conn), slog.New(slog.DiscardHandler))
	m.host.timeout = 2 * time.Second
	return m, fake, stop
}

type families map[string]*dto.MetricFamily

func scrape(t *testing.T, m *Metrics) families {
	t.Helper()
	rec := httptest.NewRecorder()
	m.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("scrape: status %d: %s", rec.Code, rec.Body)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(rec.Body)
	if err != nil {
		t.Fatalf("parse exposition: %v", err)
	}
	return fams
}

func labelsOf(m *dto.Metric) map[string]string {
	out := map[string]string{}
	for _, l := range m.GetLabel() {
		out[l.GetName()] = l.GetValue()
	}
	return out
}

// find returns the metrics of family name whose labels include kv.
func (f families) find(name string, kv ...string) []*dto.Metric {
	var out []*dto.Metric
	for _, m := range f[name].GetMetric() {
		ls := labelsOf(m)
		ok := true
		for i := 0; i+1 < len(kv); i += 2 {
			if ls[kv[i]] != kv[i+1] {
				ok = false
			}
		}
		if ok {
			out = append(out, m)
		}
	}
	return out
}

// one returns the single metric of family name with labels kv.
func (f families) one(t *testing.T, name string, kv ...string) *dto.Metric {
	t.Helper()
	ms := f.find(name, kv...)
	if len(ms) != 1 {
		t.Fatalf("%s%v: %d series, want 1 (family has %d)", name, kv, len(ms), len(f[name].GetMetric()))
	}
	return ms[0]
}

func (f families) value(t *testing.T, name string, kv ...string) float64 {
	t.Helper()
	m := f.one(t, name, kv...)
	switch {
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Untyped != nil:
		return m.GetUntyped().GetValue()
	}
	t.Fatalf("%s%v has no simple value", name, kv)
	return 0
}

func (f families) wantType(t *testing.T, name string, typ dto.MetricType) {
	t.Helper()
	if f[name] == nil {
		t.Fatalf("family %s missing", name)
	}
	if got := f[name].GetType(); got != typ {
		t.Errorf("%s: type %v, want %v", name, got, typ)
	}
}

func (f families) want(t *testing.T, want float64, name string, kv ...string) {
	t.Helper()
	if got := f.value(t, name, kv...); got != want {
		t.Errorf("%s%v = %v, want %v", name, kv, got, want)
	}
}

func (f families) histogram(t *testing.T, name string) (count uint64, sum float64) {
	t.Helper()
	h := f.one(t, name).GetHistogram()
	if h == nil {
		t.Fatalf("%s is not a histogram", name)
	}
	return h.GetSampleCount(), h.GetSampleSum()
}

func TestHostCollector(t *testing.T) {
	m, fake, _ := newHost(t)
	f := scrape(t, m)

	f.want(t, 1, "vm_manager_backend_up", "backend", "hypervisor")
	f.want(t, 0, "vm_manager_scrape_errors_total", "backend", "hypervisor")

	// State: one-hot over every state.
	f.wantType(t, "vm_manager_vm_state", dto.MetricType_GAUGE)
	wantStates := []string{"creating", "installing", "booting", "attesting", "ready", "running", "stopping", "stopped", "failed", "deleting"}
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

func TestNormalizePath(t *testing.T) {
	for in, want := range map[string]string{
		"/api/v1/vms":                                  "/api/v1/vms",
		"/api/v1/vms/ab12cd34":                         "/api/v1/vms/{id}",
		"/api/v1/vms/ab12cd34/start":                   "/api/v1/vms/{id}/start",
		"/api/v1/vms/ab12cd34/console":                 "/api/v1/vms/{id}/console",
		"/api/v1/vms/ab12cd34/bogus":                   "/api/v1/{unmatched}",
		"/api/v1/vms/ab12cd34/start/x":                 "/api/v1/{unmatched}",
		"/api/v1/vms/":                                 "/api/v1/{unmatched}",
		"/api/v1/networks/default":                     "/api/v1/networks/{name}",
		"/api/v1/images/flatcar_1.2.3":                 "/api/v1/images/{ref}",
		"/api/v1/images/flatcar/policy":                "/api/v1/images/{ref}/policy",
		"/api/v1/images/flatcar/policy/golden":         "/api/v1/images/{ref}/policy/golden",
		"/api/v1/host":                                 "/api/v1/host",
		"/api/v1/openapi.yaml":                         "/api/v1/openapi.yaml",
		"/api/v1/random-thing":                         "/api/v1/{unmatched}",
		"/healthz":                                     "/healthz",
		"/wp-login.php":                                "{unmatched}",
		"/api/v1/networks/with%2Fslash":                "/api/v1/networks/{name}",
		"/api/v1/networks/default/../../../etc/passwd": "/api/v1/{unmatched}",
	} {
		if got := NormalizePath(in); got != want {
			t.Errorf("NormalizePath(%q) = %q, want %q", in, got, want)
		}
	}
}

// requests returns the vm_manager_requests_total series as
// "surface method code" → value.
func requests(t *testing.T, m *Metrics) map[string]float64 {
	t.Helper()
	f := scrape(t, m)
	out := map[string]float64{}
	for _, s := range f.find("vm_manager_requests_total") {
		l := labelsOf(s)
		out[l["surface"]+" "+l["method"]+" "+l["code"]] = s.GetCounter().GetValue()
	}
	return out
}

func durationCount(t *testing.T, m *Metrics, surface, method string) uint64 {
	t.Helper()
	return scrape(t, m).one(t, "vm_manager_request_duration_seconds", "surface", surface, "method", method).GetHistogram().GetSampleCount()
}

func diffCounts(t *testing.T, got, want map[string]float64) {
	t.Helper()
	var keys []string
	for k := range got {
		keys = append(keys, k)
	}
	for k := range want {
		if _, ok := got[k]; !ok {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	for _, k := range keys {
		if got[k] != want[k] {
			t.Errorf("requests_total{%s} = %v, want %v", k, got[k], want[k])
		}
	}
}

func TestHTTPMiddleware(t *testing.T) {
	m := New(nil, nil)

	// A plain handler: the path is normalised.
	api := m.HTTP(SurfaceREST, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case strings.HasSuffix(r.URL.Path, "/start"):
			if err := http.NewResponseController(w).Flush(); err != nil { // a streaming handler still works
				t.Errorf("flush: %v", err)
			}
		case r.Method == http.MethodPost:
			w.WriteHeader(http.StatusCreated)
		case strings.Contains(r.URL.Path, "nope"):
			http.Error(w, "not found", http.StatusNotFound)
		default:
			_, _ = w.Write([]byte("{}"))
		}
	}))
	for _, c := range []struct{ method, path string }{
		{"POST", "/api/v1/vms/ab12cd34/start"},
		{"POST", "/api/v1/vms/ff00ff00/start"},
		{"GET", "/api/v1/networks/default"},
		{"GET", "/api/v1/networks/other"},
		{"GET", "/api/v1/networks/nope"},
		{"DELETE", "/api/v1/images/flatcar_1.0/policy/golden"},
		{"POST", "/api/v1/vms"},
		{"GET", "/api/v1/what/ever/x"},
		{"BREW", "/api/v1/vms"},
	} {
		api.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(c.method, c.path, nil))
	}

	// Wrapping a ServeMux: its patterns are the routes, except a subtree.
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) })
	mux.HandleFunc("GET /api/v1/vms/{id}", func(w http.ResponseWriter, _ *http.Request) {})
	mux.Handle("/api/v1/", http.NotFoundHandler())
	root := m.HTTP(SurfaceREST, mux)
	for _, c := range []struct{ method, path string }{
		{"GET", "/healthz"},
		{"HEAD", "/healthz"},
		{"GET", "/api/v1/vms/0123abcd"},
		{"GET", "/api/v1/vms/0123abcd/metrics"},
		{"GET", "/nothing/here"},
	} {
		root.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(c.method, c.path, nil))
	}

	diffCounts(t, requests(t, m), map[string]float64{
		"rest POST /api/v1/vms/{id}/start 200":               2,
		"rest GET /api/v1/networks/{name} 200":               2,
		"rest GET /api/v1/networks/{name} 404":               1,
		"rest DELETE /api/v1/images/{ref}/policy/golden 200": 1,
		"rest POST /api/v1/vms 201":                          1,
		"rest GET /api/v1/{unmatched} 200":                   1,
		"rest OTHER /api/v1/vms 200":                         1,
		"rest GET /healthz 200":                              1,
		"rest HEAD /healthz 200":                             1,
		"rest GET /api/v1/vms/{id} 200":                      1,
		"rest GET /api/v1/vms/{id}/metrics 404":              1,
		"rest GET {unmatched} 404":                           1,
	})
	if c := durationCount(t, m, SurfaceREST, "POST /api/v1/vms/{id}/start"); c != 2 {
		t.Errorf("duration count %d, want 2", c)
	}
}

func TestObserveMCP(t *testing.T) {
	m := New(nil, nil)
	m.ObserveMCP("list_vms", "ok", 10*time.Millisecond)
	m.ObserveMCP("list_vms", "", 20*time.Millisecond)
	m.ObserveMCP("get_vm", "not_found", time.Millisecond)
	diffCounts(t, requests(t, m), map[string]float64{
		"mcp list_vms ok":      2,
		"mcp get_vm not_found": 1,
	})
	if c := durationCount(t, m, SurfaceMCP, "list_vms"); c != 2 {
		t.Errorf("duration count %d, want 2", c)
	}
}

func TestGRPCInterceptors(t *testing.T) {
	m := New(nil, nil)
	// Like the gateway: health registered, everything else through an
	// UnknownServiceHandler forwarder.
	srv := grpc.NewServer(
		grpc.UnaryInterceptor(m.UnaryServerInterceptor()),
		grpc.StreamInterceptor(m.StreamServerInterceptor()),
		grpc.UnknownServiceHandler(func(_ any, ss grpc.ServerStream) error {
			method, _ := grpc.MethodFromServerStream(ss)
			switch method {
			case "/vmmanager.hypervisor.v1.HypervisorService/ListNetworks":
				var req hypervisorv1.ListNetworksRequest
				if err := ss.RecvMsg(&req); err != nil {
					return err
				}
				return ss.SendMsg(&hypervisorv1.ListNetworksResponse{})
			case "/vmmanager.hypervisor.v1.HypervisorService/GetVirtualMachine":
				return status.Error(codes.NotFound, "no such vm")
			}
			return status.Errorf(codes.Unimplemented, "unknown method %s", method)
		}),
	)
	healthpb.RegisterHealthServer(srv, health.NewServer())
	conn, _ := serve(t, srv)
	ctx := context.Background()

	if _, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	hv := hypervisorv1.NewHypervisorServiceClient(conn)
	for range 2 {
		if _, err := hv.ListNetworks(ctx, &hypervisorv1.ListNetworksRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := hv.GetVirtualMachine(ctx, &hypervisorv1.GetVirtualMachineRequest{Id: "x"}); status.Code(err) != codes.NotFound {
		t.Fatalf("GetVirtualMachine: %v, want NotFound", err)
	}
	for i := range 3 { // made-up names collapse into one label
		err := conn.Invoke(ctx, fmt.Sprintf("/evil.Service%d/Method", i), &hypervisorv1.ListNetworksRequest{}, &hypervisorv1.ListNetworksResponse{})
		if status.Code(err) != codes.Unimplemented {
			t.Fatalf("made-up method: %v", err)
		}
	}

	diffCounts(t, requests(t, m), map[string]float64{
		"grpc /grpc.health.v1.Health/Check OK":                                       1,
		"grpc /vmmanager.hypervisor.v1.HypervisorService/ListNetworks OK":            2,
		"grpc /vmmanager.hypervisor.v1.HypervisorService/GetVirtualMachine NotFound": 1,
		"grpc unknown Unimplemented":                                                 3,
	})
	if c := durationCount(t, m, SurfaceGRPC, "/vmmanager.hypervisor.v1.HypervisorService/ListNetworks"); c != 2 {
		t.Errorf("duration count %d, want 2", c)
	}
}

func TestGRPCMethodLabel(t *testing.T) {
	for in, want := range map[string]string{
		"/vmmanager.hypervisor.v1.HypervisorService/ListVirtualMachines": "/vmmanager.hypervisor.v1.HypervisorService/ListVirtualMachines",
		"/vmmanager.hypervisor.v1.HypervisorService/Nope":                "unknown",
		"/vmmanager.hypervisor.v1.HypervisorService":                     "unknown",
		"/vmmanager.hypervisor.v1.VirtualMachine/Id":                     "unknown",
		"":       "unknown",
		"/a/b/c": "unknown",
	} {
		if got := GRPCMethodLabel(in); got != want {
			t.Errorf("GRPCMethodLabel(%q) = %q, want %q", in, got, want)
		}
	}
}

// Two guests exporting one family with different types would make the
// exposition invalid: the second one's series is left out, the rest served.
func TestGuestCollectorTypeConflict(t *testing.T) {
	m, fake, _ := newHost(t)
	fake.mu.Lock()
	fake.guests = []*hypervisorv1.VirtualMachineGuestSeries{
		{VmId: "aaaa0001", Series: []*hypervisorv1.GuestSeries{
			{Name: "x", Type: hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_COUNTER, Value: 5},
			{Name: "y", Type: hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_GAUGE, Value: 1},
		}},
		{VmId: "bbbb0002", Series: []*hypervisorv1.GuestSeries{
			{Name: "x", Type: hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_GAUGE, Value: 7},
			{Name: "y", Type: hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_GAUGE, Labels: map[string]string{"a": "b"}, Value: 2},
		}},
	}
	fake.mu.Unlock()
	f := scrape(t, m)
	f.wantType(t, "vm_guest_x", dto.MetricType_COUNTER)
	if n := len(f.find("vm_guest_x")); n != 1 {
		t.Errorf("vm_guest_x: %d series, want aaaa0001's only", n)
	}
	f.want(t, 2, "vm_guest_y", "vm", "bbbb0002", "a", "b")
	f.want(t, 1, "vm_guest_y", "vm", "aaaa0001")
}
