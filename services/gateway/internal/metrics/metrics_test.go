package metrics

import (
	"context"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
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
	bounds   *hypervisorv1.GetBoundCountersResponse // nil: Unimplemented, as an older hypervisor
	// authSeen records whether any call carried an authorization header.
	authSeen bool
}

// begin notes whether the call carried an authorization header and takes
// the fake's lock; the function it returns releases it.
func (f *fakeHV) begin(ctx context.Context) (unlock func()) {
	md, _ := metadata.FromIncomingContext(ctx)
	f.mu.Lock()
	if len(md.Get("authorization")) > 0 {
		f.authSeen = true
	}
	return f.mu.Unlock
}

// clones copies messages, so a caller cannot change the fake's.
func clones[M proto.Message](in []M) []M {
	var out []M
	for _, m := range in {
		out = append(out, proto.CloneOf(m))
	}
	return out
}

func (f *fakeHV) ListVirtualMachines(ctx context.Context, _ *hypervisorv1.ListVirtualMachinesRequest) (*hypervisorv1.ListVirtualMachinesResponse, error) {
	defer f.begin(ctx)()
	return &hypervisorv1.ListVirtualMachinesResponse{Vms: clones(f.vms)}, nil
}

func (f *fakeHV) GetVirtualMachineMetrics(ctx context.Context, r *hypervisorv1.GetVirtualMachineMetricsRequest) (*hypervisorv1.VirtualMachineMetrics, error) {
	defer f.begin(ctx)()
	m, ok := f.metrics[r.GetId()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "vm %s not found", r.GetId())
	}
	return proto.CloneOf(m), nil
}

func (f *fakeHV) ListNetworks(ctx context.Context, _ *hypervisorv1.ListNetworksRequest) (*hypervisorv1.ListNetworksResponse, error) {
	defer f.begin(ctx)()
	return &hypervisorv1.ListNetworksResponse{Networks: clones(f.networks)}, nil
}

func (f *fakeHV) ListGuestSeries(ctx context.Context, _ *hypervisorv1.ListGuestSeriesRequest) (*hypervisorv1.ListGuestSeriesResponse, error) {
	defer f.begin(ctx)()
	return &hypervisorv1.ListGuestSeriesResponse{Vms: clones(f.guests)}, nil
}

func (f *fakeHV) GetBoundCounters(ctx context.Context, _ *hypervisorv1.GetBoundCountersRequest) (*hypervisorv1.GetBoundCountersResponse, error) {
	defer f.begin(ctx)()
	if f.bounds == nil {
		return nil, status.Error(codes.Unimplemented, "unknown method")
	}
	return proto.Clone(f.bounds).(*hypervisorv1.GetBoundCountersResponse), nil
}

var t0 = time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)

func at(d time.Duration) *timestamppb.Timestamp { return timestamppb.New(t0.Add(d)) }

// newFake has two VMs, alpha (ready, attestation released, with a guest
// report) and beta (stopped, attestation disabled, no process), on network
// "default".
func newFake() *fakeHV {
	net := func(dropped int64) *hypervisorv1.NetworkMetrics {
		return &hypervisorv1.NetworkMetrics{Name: "default", BytesSent: 1000, BytesReceived: 2000, Leases: 2, DroppedFrames: dropped,
			EgressDroppedByReason: map[string]int64{"rule": 2 * dropped, "local": dropped}, NatTcpFlows: 4, NatUdpFlows: int32(dropped),
			NatRefused: map[string]int64{"tcp_vm_limit": 0, "udp_vm_limit": 5 * dropped}, DnsRefused: map[string]int64{"policy": dropped},
			ImdsConnections: 1, ImdsConnectionsRefused: 6 * dropped, ImdsConnectionsTimedOut: dropped}
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
				BootPhases: &hypervisorv1.BootPhases{ProvisionSeconds: 0.5, RegisterSeconds: 0.01, SwtpmSeconds: 0.02, QemuSeconds: 0.25,
					FirmwareSeconds: proto.Float64(3), KernelSeconds: proto.Float64(2), AgentSeconds: proto.Float64(1.5), TotalSeconds: proto.Float64(7.5)},
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
