// Package apiserver implements vmmanager.hypervisor.v1.HypervisorService.
// Handlers return domain errors (sdk/apierr); pkg/mesh converts them to gRPC
// statuses once.
package apiserver

import (
	"context"

	"google.golang.org/grpc"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/sdk/apierr"
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

// VMs are the VM records (vm.Table).
type VMs interface {
	Get(id string) (*hypervisorv1.VirtualMachine, error)
	List() []*hypervisorv1.VirtualMachine
}

// Lifecycle is the VM verbs (vm.Manager).
type Lifecycle interface {
	Create(ctx context.Context, req *hypervisorv1.CreateVirtualMachineRequest, createdBy string) (*hypervisorv1.VirtualMachine, error)
	Fork(ctx context.Context, req *hypervisorv1.ForkVirtualMachineRequest, createdBy string) (*hypervisorv1.ForkVirtualMachineResponse, error)
	Start(ctx context.Context, id string) (*hypervisorv1.VirtualMachine, error)
	Stop(ctx context.Context, id string) (*hypervisorv1.VirtualMachine, error)
	Reboot(ctx context.Context, id string) (*hypervisorv1.VirtualMachine, error)
	Suspend(ctx context.Context, id string) (*hypervisorv1.VirtualMachine, error)
	Resume(ctx context.Context, id string) (*hypervisorv1.VirtualMachine, error)
	Delete(ctx context.Context, id string) error
	SuspendCounters() *hypervisorv1.SuspendCounters
}

// Lifetimes change a VM's expiry and idle timeout (vm.Activity).
type Lifetimes interface {
	UpdateLifetime(ctx context.Context, req *hypervisorv1.UpdateVirtualMachineLifetimeRequest) (*hypervisorv1.VirtualMachine, error)
}

// Access reaches into a VM (vm.Access).
type Access interface {
	Exec(ctx context.Context, id string, command []string) (*hypervisorv1.ExecVirtualMachineResponse, error)
	Forward(ctx context.Context, id string, port int32) (*hypervisorv1.ForwardVirtualMachinePortResponse, error)
	Metrics(id string) (*hypervisorv1.VirtualMachineMetrics, error)
}

// Consoles read a VM's serial console (vm.Consoles).
type Consoles interface {
	Console(id string, lines int32) (*hypervisorv1.GetVirtualMachineConsoleResponse, error)
}

// Watches stream the VMs' changes (vm.Watches).
type Watches interface {
	Watch(ctx context.Context, req *hypervisorv1.WatchVirtualMachinesRequest, send func(*hypervisorv1.WatchVirtualMachinesResponse) error) error
}

// Networks are the host's networks (network.Registry).
type Networks interface {
	Create(req *hypervisorv1.CreateNetworkRequest, createdBy string) (*hypervisorv1.Network, error)
	Get(name string) (*hypervisorv1.Network, error)
	List() []*hypervisorv1.Network
	Delete(name string) error
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

// Importer turns OCI images into catalog images (imageimport.Importer).
type Importer interface {
	Import(ctx context.Context, req *hypervisorv1.ImportImageRequest, progress func(*hypervisorv1.ImportImageResponse) error) (*hypervisorv1.ImportImageResponse, error)
	// Refusals count imports refused at --max-image-bytes and --image-store-bytes.
	Refusals() (imageBytes, store uint64)
}

// Pools are the warm pools (pool.Pools).
type Pools interface {
	Create(req *hypervisorv1.CreatePoolRequest) (*hypervisorv1.Pool, error)
	Get(name string) (*hypervisorv1.Pool, error)
	List() []*hypervisorv1.Pool
	Resize(ctx context.Context, name string, size int32) (*hypervisorv1.Pool, error)
	Delete(ctx context.Context, name string) (*hypervisorv1.DeletePoolResponse, error)
	// RefusedAtDiskQuota counts refills refused at --pool-disk-bytes.
	RefusedAtDiskQuota() uint64
}

// Deps are what the HypervisorService serves from.
type Deps struct {
	Host      HostProber
	Catalog   Catalog
	VMs       VMs
	Lifecycle Lifecycle
	Lifetimes Lifetimes
	Access    Access
	Consoles  Consoles
	Watches   Watches
	Networks  Networks
	Guests    Guests
	Bounds    Bounds
	Importer  Importer // nil: ImportImage is unsupported
	Pools     Pools
}

// Server is the HypervisorService.
type Server struct {
	// Unsafe, not Unimplemented: an RPC without a handler does not compile.
	hypervisorv1.UnsafeHypervisorServiceServer
	Deps
	exec ExecStreams // nil: ExecVirtualMachineStream is unsupported
}

// New returns a HypervisorService over its dependencies.
func New(d Deps) *Server { return &Server{Deps: d} }

func (s *Server) GetHost(ctx context.Context, _ *hypervisorv1.GetHostRequest) (*hypervisorv1.Host, error) {
	return s.Host.Report(ctx), nil
}

func (s *Server) ListImages(context.Context, *hypervisorv1.ListImagesRequest) (*hypervisorv1.ListImagesResponse, error) {
	return &hypervisorv1.ListImagesResponse{Images: s.Catalog.List()}, nil
}

func (s *Server) GetImage(_ context.Context, req *hypervisorv1.GetImageRequest) (*hypervisorv1.Image, error) {
	return s.Catalog.Get(req.GetRef())
}

// ImportImage streams the import's progress, then the image.
func (s *Server) ImportImage(req *hypervisorv1.ImportImageRequest, ss grpc.ServerStreamingServer[hypervisorv1.ImportImageResponse]) error {
	if s.Importer == nil {
		return apierr.Errorf(apierr.Unsupported, "this hypervisor does not import images")
	}
	last, err := s.Importer.Import(ss.Context(), req, ss.Send)
	if err != nil {
		return err
	}
	return ss.Send(last)
}

func (s *Server) ListNetworks(context.Context, *hypervisorv1.ListNetworksRequest) (*hypervisorv1.ListNetworksResponse, error) {
	return &hypervisorv1.ListNetworksResponse{Networks: s.Networks.List()}, nil
}

func (s *Server) GetNetwork(_ context.Context, req *hypervisorv1.GetNetworkRequest) (*hypervisorv1.Network, error) {
	return s.Networks.Get(req.GetName())
}

func (s *Server) CreateNetwork(ctx context.Context, req *hypervisorv1.CreateNetworkRequest) (*hypervisorv1.Network, error) {
	return s.Networks.Create(req, identity.FromContext(ctx).String())
}

func (s *Server) DeleteNetwork(ctx context.Context, req *hypervisorv1.DeleteNetworkRequest) (*hypervisorv1.DeleteNetworkResponse, error) {
	if err := s.Networks.Delete(req.GetName()); err != nil {
		return nil, err
	}
	return &hypervisorv1.DeleteNetworkResponse{Name: req.GetName(), Deleted: true}, nil
}

func (s *Server) ListVirtualMachines(context.Context, *hypervisorv1.ListVirtualMachinesRequest) (*hypervisorv1.ListVirtualMachinesResponse, error) {
	return &hypervisorv1.ListVirtualMachinesResponse{Vms: s.VMs.List()}, nil
}

func (s *Server) GetVirtualMachine(_ context.Context, req *hypervisorv1.GetVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.VMs.Get(req.GetId())
}

func (s *Server) CreateVirtualMachine(ctx context.Context, req *hypervisorv1.CreateVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.Lifecycle.Create(ctx, req, identity.FromContext(ctx).String())
}

func (s *Server) ForkVirtualMachine(ctx context.Context, req *hypervisorv1.ForkVirtualMachineRequest) (*hypervisorv1.ForkVirtualMachineResponse, error) {
	return s.Lifecycle.Fork(ctx, req, identity.FromContext(ctx).String())
}

func (s *Server) DeleteVirtualMachine(ctx context.Context, req *hypervisorv1.DeleteVirtualMachineRequest) (*hypervisorv1.DeleteVirtualMachineResponse, error) {
	if err := s.Lifecycle.Delete(ctx, req.GetId()); err != nil {
		return nil, err
	}
	return &hypervisorv1.DeleteVirtualMachineResponse{Id: req.GetId(), Deleted: true}, nil
}

func (s *Server) StartVirtualMachine(ctx context.Context, req *hypervisorv1.StartVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.Lifecycle.Start(ctx, req.GetId())
}

func (s *Server) StopVirtualMachine(ctx context.Context, req *hypervisorv1.StopVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.Lifecycle.Stop(ctx, req.GetId())
}

func (s *Server) RebootVirtualMachine(ctx context.Context, req *hypervisorv1.RebootVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.Lifecycle.Reboot(ctx, req.GetId())
}

func (s *Server) SuspendVirtualMachine(ctx context.Context, req *hypervisorv1.SuspendVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.Lifecycle.Suspend(ctx, req.GetId())
}

func (s *Server) CreatePool(_ context.Context, req *hypervisorv1.CreatePoolRequest) (*hypervisorv1.Pool, error) {
	return s.Pools.Create(req)
}

func (s *Server) ListPools(context.Context, *hypervisorv1.ListPoolsRequest) (*hypervisorv1.ListPoolsResponse, error) {
	return &hypervisorv1.ListPoolsResponse{Pools: s.Pools.List()}, nil
}

func (s *Server) GetPool(_ context.Context, req *hypervisorv1.GetPoolRequest) (*hypervisorv1.Pool, error) {
	return s.Pools.Get(req.GetName())
}

func (s *Server) ResizePool(ctx context.Context, req *hypervisorv1.ResizePoolRequest) (*hypervisorv1.Pool, error) {
	return s.Pools.Resize(ctx, req.GetName(), req.GetSize())
}

func (s *Server) DeletePool(ctx context.Context, req *hypervisorv1.DeletePoolRequest) (*hypervisorv1.DeletePoolResponse, error) {
	return s.Pools.Delete(ctx, req.GetName())
}

func (s *Server) ResumeVirtualMachine(ctx context.Context, req *hypervisorv1.ResumeVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.Lifecycle.Resume(ctx, req.GetId())
}

func (s *Server) GetVirtualMachineConsole(_ context.Context, req *hypervisorv1.GetVirtualMachineConsoleRequest) (*hypervisorv1.GetVirtualMachineConsoleResponse, error) {
	return s.Consoles.Console(req.GetId(), req.GetLines())
}

func (s *Server) GetVirtualMachineMetrics(_ context.Context, req *hypervisorv1.GetVirtualMachineMetricsRequest) (*hypervisorv1.VirtualMachineMetrics, error) {
	return s.Access.Metrics(req.GetId())
}

func (s *Server) ExecVirtualMachine(ctx context.Context, req *hypervisorv1.ExecVirtualMachineRequest) (*hypervisorv1.ExecVirtualMachineResponse, error) {
	return s.Access.Exec(ctx, req.GetId(), req.GetCommand())
}

func (s *Server) ForwardVirtualMachinePort(ctx context.Context, req *hypervisorv1.ForwardVirtualMachinePortRequest) (*hypervisorv1.ForwardVirtualMachinePortResponse, error) {
	return s.Access.Forward(ctx, req.GetId(), req.GetPort())
}

func (s *Server) UpdateVirtualMachineLifetime(ctx context.Context, req *hypervisorv1.UpdateVirtualMachineLifetimeRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.Lifetimes.UpdateLifetime(ctx, req)
}

func (s *Server) GetVirtualMachineReport(_ context.Context, req *hypervisorv1.GetVirtualMachineReportRequest) (*hypervisorv1.GetVirtualMachineReportResponse, error) {
	return s.Guests.Report(req.GetId())
}

// WatchVirtualMachines streams the VMs' changes (vm.Watches.Watch).
func (s *Server) WatchVirtualMachines(req *hypervisorv1.WatchVirtualMachinesRequest, stream hypervisorv1.HypervisorService_WatchVirtualMachinesServer) error {
	return s.Watches.Watch(stream.Context(), req, stream.Send)
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
	return &hypervisorv1.ListGuestSeriesResponse{Vms: t.s.Guests.GuestSeries()}, nil
}

func (t *Telemetry) GetBoundCounters(context.Context, *hypervisorv1.GetBoundCountersRequest) (*hypervisorv1.GetBoundCountersResponse, error) {
	return t.s.boundCounters(), nil
}

func (t *Telemetry) GetSuspendCounters(context.Context, *hypervisorv1.GetSuspendCountersRequest) (*hypervisorv1.SuspendCounters, error) {
	return t.s.Lifecycle.SuspendCounters(), nil
}

func (t *Telemetry) ListPools(ctx context.Context, req *hypervisorv1.ListPoolsRequest) (*hypervisorv1.ListPoolsResponse, error) {
	return t.s.ListPools(ctx, req)
}
