package vm

import (
	"context"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/giantswarm/vm-manager/gen/apierr"
	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/store/storepb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// This file is what a guest reaches through the IMDS: nonces and quotes
// (relayed to the attestation service, which decides), user-data behind the
// attestation gate, keys, reports and sysupdate files.

// ByIP finds the VM holding a lease on ip; VMs being deleted are excluded.
func (m *Manager) ByIP(ip netip.Addr) (*hypervisorv1.VirtualMachine, bool) {
	ip = ip.Unmap()
	for _, rec := range m.records() {
		if rec.GetState() == hypervisorv1.State_STATE_DELETING || rec.GetIp() == "" {
			continue
		}
		if a, err := netip.ParseAddr(rec.GetIp()); err == nil && a == ip {
			return View(rec), true
		}
	}
	return nil, false
}

// IssueNonce asks attestation for a nonce; the first one of a boot moves a VM
// that requires attestation from booting to attesting.
func (m *Manager) IssueNonce(ctx context.Context, vmID string) ([]byte, error) {
	mc, err := m.get(vmID)
	if err != nil {
		return nil, err
	}
	if m.verifier == nil {
		return nil, apierr.Errorf(apierr.Unavailable, "no attestation service")
	}
	if err := m.beginLate(ctx, mc); err != nil {
		return nil, err
	}
	resp, err := m.verifier.IssueNonce(ctx, &attestationv1.IssueNonceRequest{VmId: vmID})
	if err != nil {
		return nil, err
	}
	m.update(mc, func(r *storepb.VirtualMachine) {
		if r.Attestation == nil {
			r.Attestation = &attestationv1.Attestation{}
		}
		r.Attestation.NonceIssuedAt = timestamppb.Now()
		if r.GetRequireAttestation() && r.GetState() == hypervisorv1.State_STATE_BOOTING {
			r.State = hypervisorv1.State_STATE_ATTESTING
		}
	})
	return resp.GetNonce(), nil
}

// lateBoots serialises beginLate, so that concurrent nonce requests of one
// boot begin it once.
var lateBoots sync.Mutex

// beginLate begins the VM's current boot in attestation when its launch
// could not (attestation was down then; the record's attestation has no boot
// number). Without it attestation refuses the boot's nonces (a VM it has
// never seen: the guest retried until the boot timeout, found by the fault
// suite) or takes the guest's quotes as the previous boot's, whose verified
// verdict a rejected quote does not erase.
func (m *Manager) beginLate(ctx context.Context, mc *machine) error {
	if rec, _ := mc.snapshot(); rec.GetAttestation().GetBoot() != 0 || rec.GetPhase() != hypervisorv1.Phase_PHASE_BOOT {
		return nil
	}
	lateBoots.Lock()
	defer lateBoots.Unlock()
	rec, _ := mc.snapshot()
	if rec.GetAttestation().GetBoot() != 0 {
		return nil
	}
	att, err := m.verifier.BeginBoot(ctx, m.beginBootRequest(rec))
	if err != nil {
		return err
	}
	m.log.Info("attestation recorded the boot at the guest's first nonce (it was unavailable at launch)", "vm", mc.id, "boot", att.GetBoot())
	m.update(mc, func(r *storepb.VirtualMachine) {
		if r.GetAttestation().GetBoot() == 0 {
			r.Attestation = att
		}
	})
	return nil
}

// rejectedPrefix marks a lastError written by a rejected initrd quote, which
// a verified retry clears.
const rejectedPrefix = "initrd attestation rejected: "

// SubmitQuote relays a quote to attestation and copies the verdict onto the
// VM record; a verified initrd quote opens the user-data gate.
func (m *Manager) SubmitQuote(ctx context.Context, vmID string, q *attestationv1.VerifyQuoteRequest) (*attestationv1.VerifyQuoteResponse, error) {
	mc, err := m.get(vmID)
	if err != nil {
		return nil, err
	}
	if m.verifier == nil {
		return nil, apierr.Errorf(apierr.Unavailable, "no attestation service")
	}
	q.VmId = vmID
	resp, err := m.verifier.VerifyQuote(ctx, q)
	if err != nil {
		return nil, err
	}
	m.update(mc, func(r *storepb.VirtualMachine) {
		r.Attestation = resp.GetAttestation()
		if q.GetStage() != attestationv1.Stage_STAGE_INITRD {
			return
		}
		switch {
		case !resp.GetVerified():
			r.LastError = rejectedPrefix + resp.GetMessage()
		case strings.HasPrefix(r.GetLastError(), rejectedPrefix):
			r.LastError = ""
		}
	})
	return resp, nil
}

// UserData returns the VM's user-data, whether it has any, and whether the
// attestation gate is open.
func (m *Manager) UserData(vmID string) ([]byte, bool, bool, error) {
	mc, err := m.get(vmID)
	if err != nil {
		return nil, false, false, err
	}
	rec, _ := mc.snapshot()
	path := rec.GetPaths().GetUserData()
	if path == "" {
		return nil, false, false, nil
	}
	released := rec.GetAttestation().GetUserDataReleased()
	if !released {
		return nil, true, false, nil
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, true, true, err
	}
	return b, true, true, nil
}

// SSHKeys are the keys served at public-keys/: vm-manager's per-VM key first
// (once the VM has one), then the caller's.
func (m *Manager) SSHKeys(vmID string) []string {
	rec, err := m.record(vmID)
	if err != nil {
		return nil
	}
	var keys []string
	if k := rec.GetSshPublicKey(); k != "" {
		keys = append(keys, k)
	}
	return append(keys, rec.GetSshAuthorizedKeys()...)
}

// StoreReport keeps the guest's last report upload in vms/<id>/report.json.
func (m *Manager) StoreReport(vmID string, body []byte) error {
	mc, err := m.get(vmID)
	if err != nil {
		return err
	}
	rec, _ := mc.snapshot()
	path := filepath.Join(rec.GetPaths().GetDir(), "report.json")
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, body, 0o600); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	if rec.GetPaths().GetReport() != path {
		m.update(mc, func(r *storepb.VirtualMachine) { r.Paths.Report = path })
	}
	g, err := parseReport(body, time.Now(), m.cfg.GuestSeriesLimit)
	mc.mu.Lock()
	defer mc.mu.Unlock()
	mc.guest.loaded = true
	mc.guest.report, mc.guest.note = g, ""
	if err != nil {
		mc.guest.note = noteNotReport
	}
	mc.guest.reportsTotal++
	if g != nil {
		if mc.guest.dropped == nil {
			mc.guest.dropped = map[string]uint64{}
		}
		for r, n := range g.dropped {
			mc.guest.dropped[r] += n
		}
	}
	return nil
}

// guestState is a VM's guest report as the metrics see it, guarded by the
// machine's mu. The counters count uploads since this process started.
type guestState struct {
	loaded       bool         // report and note are set (after a restart, from report.json)
	report       *guestReport // nil: no upload, or not a systemd-report (note says which)
	note         string
	reportsTotal uint64
	dropped      map[string]uint64
}

// guestReportOf returns the VM's parsed last upload; the first call after a
// restart reads the kept report.json.
func (m *Manager) guestReportOf(mc *machine) (*guestReport, string) {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	if !mc.guest.loaded {
		mc.guest.report, mc.guest.note = readReport(mc.rec.GetPaths().GetReport(), m.cfg.GuestSeriesLimit)
		mc.guest.loaded = true
	}
	return mc.guest.report, mc.guest.note
}

// GuestSeries is every VM's exported guest series (TelemetryService), oldest
// VM first.
func (m *Manager) GuestSeries() []*hypervisorv1.VirtualMachineGuestSeries {
	var out []*hypervisorv1.VirtualMachineGuestSeries
	for _, rec := range m.records() {
		mc, err := m.get(rec.GetId())
		if err != nil {
			continue // deleted since
		}
		g, _ := m.guestReportOf(mc)
		vs := &hypervisorv1.VirtualMachineGuestSeries{VmId: rec.GetId(), SeriesDroppedTotal: map[string]uint64{}}
		mc.mu.Lock()
		vs.ReportsTotal = mc.guest.reportsTotal
		for _, r := range dropReasons {
			vs.SeriesDroppedTotal[r] = mc.guest.dropped[r]
		}
		mc.mu.Unlock()
		if g != nil {
			vs.ReceivedAt = timestamppb.New(g.receivedAt)
			vs.Entries = int32(g.entries)
			vs.Series = g.series
		}
		out = append(out, vs)
	}
	return out
}

// Report returns the guest's last upload as JSON (a non-JSON upload as a string).
func (m *Manager) Report(vmID string) (*hypervisorv1.GetVirtualMachineReportResponse, error) {
	mc, err := m.get(vmID)
	if err != nil {
		return nil, err
	}
	rec, _ := mc.snapshot()
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

// SysupdateFile opens <image-dir>/sysupdate/<component>/<file>: one level, a
// regular file, nothing that climbs out.
func (m *Manager) SysupdateFile(component, file string) (io.ReadSeekCloser, int64, error) {
	for _, part := range []string{component, file} {
		if part == "" || part == "." || part == ".." || strings.ContainsAny(part, "/\\\x00") {
			return nil, 0, apierr.Errorf(apierr.NotFound, "no such sysupdate file")
		}
	}
	if m.cfg.ImageDir == "" {
		return nil, 0, apierr.Errorf(apierr.NotFound, "no image directory")
	}
	f, err := os.Open(filepath.Join(m.cfg.ImageDir, "sysupdate", component, file))
	if err != nil {
		return nil, 0, apierr.Errorf(apierr.NotFound, "no such sysupdate file")
	}
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return nil, 0, apierr.Errorf(apierr.NotFound, "no such sysupdate file")
	}
	return f, fi.Size(), nil
}
