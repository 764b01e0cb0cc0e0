package guestapi

import (
	"os"
	"path/filepath"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// reportState is a VM's guest report as the metrics see it, guarded by the
// side's mu. The counters count uploads since this process started.
type reportState struct {
	loaded       bool         // report and note are set (after a restart, from report.json)
	report       *guestReport // nil: no upload, or not a systemd-report (note says which)
	note         string
	reportsTotal uint64
	dropped      map[string]uint64
}

// stateOf returns a VM's report state, creating it; called with mu held.
func (s *Side) stateOf(id string) *reportState {
	st := s.reports[id]
	if st == nil {
		st = &reportState{}
		s.reports[id] = st
	}
	return st
}

// StoreReport keeps the guest's last report upload in vms/<id>/report.json.
func (s *Side) StoreReport(vmID string, body []byte) error {
	rec, err := s.records.Record(vmID)
	if err != nil {
		return err
	}
	path := filepath.Join(rec.GetPaths().GetDir(), "report.json")
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, body, 0o600); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	if rec.GetPaths().GetReport() != path {
		if err := s.records.Update(vmID, func(r *storepb.VirtualMachine) { r.Paths.Report = path }); err != nil {
			return err
		}
	}
	g, err := parseReport(body, time.Now(), s.cfg.SeriesLimit)
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.stateOf(vmID)
	st.loaded = true
	st.report, st.note = g, ""
	if err != nil {
		st.note = noteNotReport
	}
	st.reportsTotal++
	if g != nil {
		if st.dropped == nil {
			st.dropped = map[string]uint64{}
		}
		for r, n := range g.dropped {
			st.dropped[r] += n
		}
	}
	return nil
}

// reportOf returns the VM's parsed last upload; the first call after a
// restart reads the kept report.json.
func (s *Side) reportOf(rec *storepb.VirtualMachine) (*guestReport, string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.stateOf(rec.GetId())
	if !st.loaded {
		st.report, st.note = readReport(rec.GetPaths().GetReport(), s.cfg.SeriesLimit)
		st.loaded = true
	}
	return st.report, st.note
}

// Summary is the guest part of a VM's metrics, or the note that says why
// there is none.
func (s *Side) Summary(rec *storepb.VirtualMachine) (*hypervisorv1.GuestMetrics, string) {
	g, note := s.reportOf(rec)
	if g == nil {
		return nil, note
	}
	return g.summary(time.Now()), ""
}

// GuestSeries is every VM's exported guest series (TelemetryService), oldest
// VM first. The state of VMs that are gone is dropped on the way.
func (s *Side) GuestSeries() []*hypervisorv1.VirtualMachineGuestSeries {
	recs := s.records.Records()
	var out []*hypervisorv1.VirtualMachineGuestSeries
	live := make(map[string]bool, len(recs))
	for _, rec := range recs {
		live[rec.GetId()] = true
		g, _ := s.reportOf(rec)
		vs := &hypervisorv1.VirtualMachineGuestSeries{VmId: rec.GetId(), SeriesDroppedTotal: map[string]uint64{}}
		s.mu.Lock()
		st := s.stateOf(rec.GetId())
		vs.ReportsTotal = st.reportsTotal
		for _, r := range dropReasons {
			vs.SeriesDroppedTotal[r] = st.dropped[r]
		}
		s.mu.Unlock()
		if g != nil {
			vs.ReceivedAt = timestamppb.New(g.receivedAt)
			vs.Entries = int32(g.entries)
			vs.Series = g.series
		}
		out = append(out, vs)
	}
	s.mu.Lock()
	for id := range s.reports {
		if !live[id] {
			delete(s.reports, id)
		}
	}
	s.mu.Unlock()
	return out
}

// Report returns the guest's last upload as JSON (a non-JSON upload as a string).
func (s *Side) Report(vmID string) (*hypervisorv1.GetVirtualMachineReportResponse, error) {
	rec, err := s.records.Record(vmID)
	if err != nil {
		return nil, err
	}
	path := rec.GetPaths().GetReport()
	if path == "" {
		return nil, apierr.Errorf(apierr.NotFound, "vm %s has not uploaded a report yet", vmID)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, apierr.Errorf(apierr.NotFound, "vm %s has not uploaded a report yet", vmID)
	}
	fi, _ := os.Stat(path)
	v := &structpb.Value{}
	if err := v.UnmarshalJSON(b); err != nil {
		v = structpb.NewStringValue(string(b))
	}
	resp := &hypervisorv1.GetVirtualMachineReportResponse{Report: v}
	if fi != nil {
		resp.ReceivedAt = timestamppb.New(fi.ModTime())
	}
	return resp, nil
}
