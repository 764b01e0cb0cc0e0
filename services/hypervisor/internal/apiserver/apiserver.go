// Package apiserver implements vmmanager.hypervisor.v1.HypervisorService.
// Handlers return domain errors (sdk/apierr); pkg/mesh converts them to gRPC
// statuses once.
package apiserver

import (
	"context"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/identity"
)

// HostProber reports the host's capabilities.
type HostProber interface {
	Report(ctx context.Context) *hypervisorv1.Host
}

// Catalog is the image catalog.
type Catalog interface {
	List() []*hypervisorv1.Image
	Get(ref string) (*hypervisorv1.Image, error)
}

// VMs is the VM lifecycle.
type VMs interface {
	Create(ctx context.Context, req *hypervisorv1.CreateVirtualMachineRequest, createdBy string) (*hypervisorv1.VirtualMachine, error)
	Get(id string) (*hypervisorv1.VirtualMachine, error)
	List() []*hypervisorv1.VirtualMachine
	Start(ctx context.Context, id string) (*hypervisorv1.VirtualMachine, error)
	Stop(ctx context.Context, id string) (*hypervisorv1.VirtualMachine, error)
	Reboot(ctx context.Context, id string) (*hypervisorv1.VirtualMachine, error)
	Suspend(ctx context.Context, id string) (*hypervisorv1.VirtualMachine, error)
	Resume(ctx context.Context, id string) (*hypervisorv1.VirtualMachine, error)
	Delete(ctx context.Context, id string) error
	Console(id string, lines int32) (*hypervisorv1.GetVirtualMachineConsoleResponse, error)
	Metrics(id string) (*hypervisorv1.VirtualMachineMetrics, error)
	Exec(ctx context.Context, id string, command []string) (*hypervisorv1.ExecVirtualMachineResponse, error)
	Forward(ctx context.Context, id string, port int32) (*hypervisorv1.ForwardVirtualMachinePortResponse, error)
	UpdateLifetime(ctx context.Context, req *hypervisorv1.UpdateVirtualMachineLifetimeRequest) (*hypervisorv1.VirtualMachine, error)

	Watch(ctx context.Context, req *hypervisorv1.WatchVirtualMachinesRequest, send func(*hypervisorv1.WatchVirtualMachinesResponse) error) error

	CreateNetwork(ctx context.Context, req *hypervisorv1.CreateNetworkRequest, createdBy string) (*hypervisorv1.Network, error)
	GetNetwork(name string) (*hypervisorv1.Network, error)
	ListNetworks() []*hypervisorv1.Network
	DeleteNetwork(ctx context.Context, name string) error
}

// Guests are the guests' report uploads.
type Guests interface {
	Report(id string) (*hypervisorv1.GetVirtualMachineReportResponse, error)
	GuestSeries() []*hypervisorv1.VirtualMachineGuestSeries
}

// Bounds are the counters of the per-VM and per-host bounds.
type Bounds interface {
	BoundCounters() *hypervisorv1.GetBoundCountersResponse
}

// Server is the HypervisorService.
type Server struct {
	// Unsafe, not Unimplemented: an RPC without a handler does not compile.
	hypervisorv1.UnsafeHypervisorServiceServer
	host    HostProber
	catalog Catalog
	vms     VMs
	guests  Guests
	bounds  Bounds
	exec    ExecStreams // nil: ExecVirtualMachineStream is unsupported
}

// New returns a HypervisorService over its dependencies.
func New(host HostProber, catalog Catalog, vms VMs, guests Guests, bounds Bounds) *Server {
	return &Server{host: host, catalog: catalog, vms: vms, guests: guests, bounds: bounds}
}

func (s *Server) GetHost(ctx context.Context, _ *hypervisorv1.GetHostRequest) (*hypervisorv1.Host, error) {
	return s.host.Report(ctx), nil
}

func (s *Server) ListImages(context.Context, *hypervisorv1.ListImagesRequest) (*hypervisorv1.ListImagesResponse, error) {
	return &hypervisorv1.ListImagesResponse{Images: s.catalog.List()}, nil
}

func (s *Server) GetImage(_ context.Context, req *hypervisorv1.GetImageRequest) (*hypervisorv1.Image, error) {
	return s.catalog.Get(req.GetRef())
}

func (s *Server) ListNetworks(context.Context, *hypervisorv1.ListNetworksRequest) (*hypervisorv1.ListNetworksResponse, error) {
	return &hypervisorv1.ListNetworksResponse{Networks: s.vms.ListNetworks()}, nil
}

func (s *Server) GetNetwork(_ context.Context, req *hypervisorv1.GetNetworkRequest) (*hypervisorv1.Network, error) {
	return s.vms.GetNetwork(req.GetName())
}

func (s *Server) CreateNetwork(ctx context.Context, req *hypervisorv1.CreateNetworkRequest) (*hypervisorv1.Network, error) {
	return s.vms.CreateNetwork(ctx, req, identity.FromContext(ctx).String())
}

func (s *Server) DeleteNetwork(ctx context.Context, req *hypervisorv1.DeleteNetworkRequest) (*hypervisorv1.DeleteNetworkResponse, error) {
	if err := s.vms.DeleteNetwork(ctx, req.GetName()); err != nil {
		return nil, err
	}
	return &hypervisorv1.DeleteNetworkResponse{Name: req.GetName(), Deleted: true}, nil
}

func (s *Server) ListVirtualMachines(context.Context, *hypervisorv1.ListVirtualMachinesRequest) (*hypervisorv1.ListVirtualMachinesResponse, error) {
	return &hypervisorv1.ListVirtualMachinesResponse{Vms: s.vms.List()}, nil
}

func (s *Server) GetVirtualMachine(_ context.Context, req *hypervisorv1.GetVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.vms.Get(req.GetId())
}

func (s *Server) CreateVirtualMachine(ctx context.Context, req *hypervisorv1.CreateVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.vms.Create(ctx, req, identity.FromContext(ctx).String())
}

func (s *Server) DeleteVirtualMachine(ctx context.Context, req *hypervisorv1.DeleteVirtualMachineRequest) (*hypervisorv1.DeleteVirtualMachineResponse, error) {
	if err := s.vms.Delete(ctx, req.GetId()); err != nil {
		return nil, err
	}
	return &hypervisorv1.DeleteVirtualMachineResponse{Id: req.GetId(), Deleted: true}, nil
}

func (s *Server) StartVirtualMachine(ctx context.Context, req *hypervisorv1.StartVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.vms.Start(ctx, req.GetId())
}

func (s *Server) StopVirtualMachine(ctx context.Context, req *hypervisorv1.StopVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.vms.Stop(ctx, req.GetId())
}

func (s *Server) RebootVirtualMachine(ctx context.Context, req *hypervisorv1.RebootVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.vms.Reboot(ctx, req.GetId())
}

func (s *Server) SuspendVirtualMachine(ctx context.Context, req *hypervisorv1.SuspendVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.vms.Suspend(ctx, req.GetId())
}

func (s *Server) ResumeVirtualMachine(ctx context.Context, req *hypervisorv1.ResumeVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.vms.Resume(ctx, req.GetId())
}

func (s *Server) GetVirtualMachineConsole(_ context.Context, req *hypervisorv1.GetVirtualMachineConsoleRequest) (*hypervisorv1.GetVirtualMachineConsoleResponse, error) {
	return s.vms.Console(req.GetId(), req.GetLines())
}

func (s *Server) GetVirtualMachineMetrics(_ context.Context, req *hypervisorv1.GetVirtualMachineMetricsRequest) (*hypervisorv1.VirtualMachineMetrics, error) {
	return s.vms.Metrics(req.GetId())
}

func (s *Server) ExecVirtualMachine(ctx context.Context, req *hypervisorv1.ExecVirtualMachineRequest) (*hypervisorv1.ExecVirtualMachineResponse, error) {
	return s.vms.Exec(ctx, req.GetId(), req.GetCommand())
}

func (s *Server) ForwardVirtualMachinePort(ctx context.Context, req *hypervisorv1.ForwardVirtualMachinePortRequest) (*hypervisorv1.ForwardVirtualMachinePortResponse, error) {
	return s.vms.Forward(ctx, req.GetId(), req.GetPort())
}

func (s *Server) UpdateVirtualMachineLifetime(ctx context.Context, req *hypervisorv1.UpdateVirtualMachineLifetimeRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.vms.UpdateLifetime(ctx, req)
}

func (s *Server) GetVirtualMachineReport(_ context.Context, req *hypervisorv1.GetVirtualMachineReportRequest) (*hypervisorv1.GetVirtualMachineReportResponse, error) {
	return s.guests.Report(req.GetId())
}

// WatchVirtualMachines streams the VMs' changes (vm.Manager.Watch).
func (s *Server) WatchVirtualMachines(req *hypervisorv1.WatchVirtualMachinesRequest, stream hypervisorv1.HypervisorService_WatchVirtualMachinesServer) error {
	return s.vms.Watch(stream.Context(), req, stream.Send)
}

// Telemetry serves the internal TelemetryService (the gateway's metrics
// collector, which has no caller token) with the same read-only handlers.
type Telemetry struct {
	hypervisorv1.UnsafeTelemetryServiceServer
	s *Server
}

// Telemetry returns the internal TelemetryService over s.
func (s *Server) Telemetry() *Telemetry { return &Telemetry{s: s} }

func (t *Telemetry) ListVirtualMachines(ctx context.Context, req *hypervisorv1.ListVirtualMachinesRequest) (*hypervisorv1.ListVirtualMachinesResponse, error) {
	return t.s.ListVirtualMachines(ctx, req)
}

func (t *Telemetry) GetVirtualMachineMetrics(ctx context.Context, req *hypervisorv1.GetVirtualMachineMetricsRequest) (*hypervisorv1.VirtualMachineMetrics, error) {
	return t.s.GetVirtualMachineMetrics(ctx, req)
}

func (t *Telemetry) ListNetworks(ctx context.Context, req *hypervisorv1.ListNetworksRequest) (*hypervisorv1.ListNetworksResponse, error) {
	return t.s.ListNetworks(ctx, req)
}

func (t *Telemetry) ListGuestSeries(context.Context, *hypervisorv1.ListGuestSeriesRequest) (*hypervisorv1.ListGuestSeriesResponse, error) {
	return &hypervisorv1.ListGuestSeriesResponse{Vms: t.s.guests.GuestSeries()}, nil
}

func (t *Telemetry) GetBoundCounters(context.Context, *hypervisorv1.GetBoundCountersRequest) (*hypervisorv1.GetBoundCountersResponse, error) {
	return t.s.boundCounters(), nil
}

// suspendCounters is the VM manager's suspend telemetry (vm/suspend.go).
type suspendCounters interface {
	SuspendCounters() *hypervisorv1.SuspendCounters
}

func (t *Telemetry) GetSuspendCounters(context.Context, *hypervisorv1.GetSuspendCountersRequest) (*hypervisorv1.SuspendCounters, error) {
	if sc, ok := t.s.vms.(suspendCounters); ok {
		return sc.SuspendCounters(), nil
	}
	return &hypervisorv1.SuspendCounters{}, nil
}
