// Package apiserver implements vmmanager.hypervisor.v1.HypervisorService.
// Handlers return domain errors (gen/apierr); pkg/mesh converts them to gRPC
// statuses once.
package apiserver

import (
	"context"
	"regexp"

	"github.com/giantswarm/vm-manager/gen/apierr"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
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

// Store holds VM and network records.
type Store interface {
	GetVM(id string) (*hypervisorv1.VirtualMachine, error)
	ListVMs() ([]*hypervisorv1.VirtualMachine, error)
	GetNetwork(name string) (*hypervisorv1.Network, error)
	ListNetworks() ([]*hypervisorv1.Network, error)
}

// Server is the HypervisorService.
type Server struct {
	hypervisorv1.UnimplementedHypervisorServiceServer
	host    HostProber
	catalog Catalog
	store   Store
}

// New returns a HypervisorService over its dependencies.
func New(host HostProber, catalog Catalog, store Store) *Server {
	return &Server{host: host, catalog: catalog, store: store}
}

var vmID = regexp.MustCompile(`^[0-9a-f]{8}$`)

// vm loads a record; an id that cannot exist is simply not found.
func (s *Server) vm(id string) (*hypervisorv1.VirtualMachine, error) {
	if !vmID.MatchString(id) {
		return nil, apierr.Errorf(apierr.NotFound, "vm %q not found", id)
	}
	return s.store.GetVM(id)
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
	nets, err := s.store.ListNetworks()
	if err != nil {
		return nil, err
	}
	return &hypervisorv1.ListNetworksResponse{Networks: nets}, nil
}

func (s *Server) GetNetwork(_ context.Context, req *hypervisorv1.GetNetworkRequest) (*hypervisorv1.Network, error) {
	return s.store.GetNetwork(req.GetName())
}

func (s *Server) ListVirtualMachines(context.Context, *hypervisorv1.ListVirtualMachinesRequest) (*hypervisorv1.ListVirtualMachinesResponse, error) {
	vms, err := s.store.ListVMs()
	if err != nil {
		return nil, err
	}
	return &hypervisorv1.ListVirtualMachinesResponse{Vms: vms}, nil
}

func (s *Server) GetVirtualMachine(_ context.Context, req *hypervisorv1.GetVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return s.vm(req.GetId())
}

// notYet answers the lifecycle calls that later work implements: an unknown
// VM is still not_found, a known one gets unsupported.
func (s *Server) notYet(id, what string) error {
	if _, err := s.vm(id); err != nil {
		return err
	}
	return apierr.Errorf(apierr.Unsupported, "%s is not implemented by this hypervisor yet", what)
}

func (s *Server) DeleteVirtualMachine(_ context.Context, req *hypervisorv1.DeleteVirtualMachineRequest) (*hypervisorv1.DeleteVirtualMachineResponse, error) {
	return nil, s.notYet(req.GetId(), "delete_vm")
}

func (s *Server) StartVirtualMachine(_ context.Context, req *hypervisorv1.StartVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return nil, s.notYet(req.GetId(), "start_vm")
}

func (s *Server) StopVirtualMachine(_ context.Context, req *hypervisorv1.StopVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return nil, s.notYet(req.GetId(), "stop_vm")
}

func (s *Server) RebootVirtualMachine(_ context.Context, req *hypervisorv1.RebootVirtualMachineRequest) (*hypervisorv1.VirtualMachine, error) {
	return nil, s.notYet(req.GetId(), "reboot_vm")
}

func (s *Server) ExecVirtualMachine(_ context.Context, req *hypervisorv1.ExecVirtualMachineRequest) (*hypervisorv1.ExecVirtualMachineResponse, error) {
	return nil, s.notYet(req.GetId(), "exec_vm")
}

func (s *Server) ForwardVirtualMachinePort(_ context.Context, req *hypervisorv1.ForwardVirtualMachinePortRequest) (*hypervisorv1.ForwardVirtualMachinePortResponse, error) {
	return nil, s.notYet(req.GetId(), "forward_port")
}

func (s *Server) GetVirtualMachineConsole(_ context.Context, req *hypervisorv1.GetVirtualMachineConsoleRequest) (*hypervisorv1.GetVirtualMachineConsoleResponse, error) {
	return nil, s.notYet(req.GetId(), "get_vm_console")
}

func (s *Server) GetVirtualMachineMetrics(_ context.Context, req *hypervisorv1.GetVirtualMachineMetricsRequest) (*hypervisorv1.VirtualMachineMetrics, error) {
	return nil, s.notYet(req.GetId(), "get_vm_metrics")
}

func (s *Server) GetVirtualMachineReport(_ context.Context, req *hypervisorv1.GetVirtualMachineReportRequest) (*hypervisorv1.GetVirtualMachineReportResponse, error) {
	return nil, s.notYet(req.GetId(), "the report")
}
