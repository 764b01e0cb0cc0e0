package apiserver

import (
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/execstream"
)

// ExecStreams serves the streamed exec sessions (execstream.Service).
type ExecStreams interface {
	Serve(execstream.Stream) error
	Counters() *hypervisorv1.ExecSessionCounters
}

// WithExecStreams serves ExecVirtualMachineStream with e.
func (s *Server) WithExecStreams(e ExecStreams) *Server {
	s.exec = e
	return s
}

func (s *Server) ExecVirtualMachineStream(stream hypervisorv1.HypervisorService_ExecVirtualMachineStreamServer) error {
	if s.exec == nil {
		return apierr.Errorf(apierr.Unsupported, "streamed exec is not served by this hypervisor")
	}
	return s.exec.Serve(stream)
}

// boundCounters adds the exec sessions, and the imports and pool refills
// refused at a bound, to the bounds' counters.
func (s *Server) boundCounters() *hypervisorv1.GetBoundCountersResponse {
	out := s.Bounds.BoundCounters()
	if s.exec != nil {
		out.ExecSessions = s.exec.Counters()
	}
	if s.Importer != nil {
		if out.RefusedTotal == nil {
			out.RefusedTotal = map[string]uint64{}
		}
		out.RefusedTotal["image_bytes"], out.RefusedTotal["image_store"] = s.Importer.Refusals()
	}
	if s.Pools != nil {
		if out.RefusedTotal == nil {
			out.RefusedTotal = map[string]uint64{}
		}
		out.RefusedTotal["pool_disk"] = s.Pools.RefusedAtDiskQuota()
	}
	return out
}
