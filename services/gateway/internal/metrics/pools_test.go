package metrics

import (
	"context"
	"sync"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// fakePools is a hypervisor's HypervisorService with settable pools, or
// an error for ListPools.
type fakePools struct {
	hypervisorv1.UnimplementedTelemetryServiceServer

	mu    sync.Mutex
	pools []*hypervisorv1.Pool
	err   error
}

func (f *fakePools) ListPools(context.Context, *hypervisorv1.ListPoolsRequest) (*hypervisorv1.ListPoolsResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.err != nil {
		return nil, f.err
	}
	return &hypervisorv1.ListPoolsResponse{Pools: clones(f.pools)}, nil
}

func (f *fakePools) set(err error, pools ...*hypervisorv1.Pool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.pools, f.err = pools, err
}

func TestPoolMetrics(t *testing.T) {
	m, _, _ := newHost(t)
	fake := &fakePools{}
	srv := grpc.NewServer()
	hypervisorv1.RegisterTelemetryServiceServer(srv, fake)
	conn, _ := serve(t, srv)
	m.AddPools(hypervisorv1.NewTelemetryServiceClient(conn))

	fake.set(nil,
		&hypervisorv1.Pool{Name: "workers", Size: 3, Status: &hypervisorv1.PoolStatus{
			Ready: 2, Filling: 1, HitsTotal: 7, MissesTotal: 2, RefillsTotal: 9, RefillFailuresTotal: 1,
			RefillSecondsTotal: 81.5, DiskBytes: 6 << 30,
		}},
		&hypervisorv1.Pool{Name: "empty"},
		&hypervisorv1.Pool{Name: "workers"}, // a duplicate would fail the scrape
	)
	f := scrape(t, m)
	f.wantType(t, "vm_manager_pool_size", dto.MetricType_GAUGE)
	f.wantType(t, "vm_manager_pool_hits_total", dto.MetricType_COUNTER)
	f.want(t, 3, "vm_manager_pool_size", "pool", "workers")
	f.want(t, 2, "vm_manager_pool_ready", "pool", "workers")
	f.want(t, 1, "vm_manager_pool_filling", "pool", "workers")
	f.want(t, 7, "vm_manager_pool_hits_total", "pool", "workers")
	f.want(t, 2, "vm_manager_pool_misses_total", "pool", "workers")
	f.want(t, 9, "vm_manager_pool_refills_total", "pool", "workers")
	f.want(t, 1, "vm_manager_pool_refill_failures_total", "pool", "workers")
	f.want(t, 81.5, "vm_manager_pool_refill_seconds_total", "pool", "workers")
	f.want(t, 6<<30, "vm_manager_pool_disk_bytes", "pool", "workers")
	f.want(t, 0, "vm_manager_pool_ready", "pool", "empty")
	f.want(t, 0, "vm_manager_scrape_errors_total", "backend", "hypervisor")

	// A hypervisor without pools, or one refusing the token-less scrape:
	// no series, no scrape error.
	for _, c := range []codes.Code{codes.Unimplemented, codes.Unauthenticated} {
		fake.set(status.Error(c, "no"))
		f = scrape(t, m)
		if len(f.find("vm_manager_pool_size")) != 0 {
			t.Errorf("%v: pool series", c)
		}
		f.want(t, 0, "vm_manager_scrape_errors_total", "backend", "hypervisor")
	}
	// Anything else is a scrape error: seen in the next scrape, as the
	// collectors of one run at once.
	fake.set(status.Error(codes.Internal, "broken"))
	scrape(t, m)
	fake.set(nil)
	scrape(t, m).want(t, 1, "vm_manager_scrape_errors_total", "backend", "hypervisor")
}

func TestNoPoolsInAFleet(t *testing.T) {
	m, _, _ := newHost(t)
	m.AddPools(nil)
	if f := scrape(t, m); len(f.find("vm_manager_pool_size")) != 0 {
		t.Error("pool series without a source")
	}
}
