package metrics

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sort"
	"strings"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
)

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
		"/api/v1/images:import":                        "/api/v1/images:import",
		"/api/v1/vms:watch":                            "/api/v1/vms:watch",
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

// wantDurations checks how many requests the method's duration histogram
// counts.
func wantDurations(t *testing.T, m *Metrics, surface, method string, want uint64) {
	t.Helper()
	if c := scrape(t, m).one(t, "vm_manager_request_duration_seconds", "surface", surface, "method", method).GetHistogram().GetSampleCount(); c != want {
		t.Errorf("%s %s: duration count %d, want %d", surface, method, c, want)
	}
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
	wantDurations(t, m, SurfaceREST, "POST /api/v1/vms/{id}/start", 2)
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
	wantDurations(t, m, SurfaceMCP, "list_vms", 2)
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
	wantDurations(t, m, SurfaceGRPC, "/vmmanager.hypervisor.v1.HypervisorService/ListNetworks", 2)
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
