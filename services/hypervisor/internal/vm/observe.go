package vm

import (
	"io/fs"
	"path/filepath"
	"syscall"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/gate"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/logtail"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/proc"
	"google.golang.org/protobuf/proto"
)

// Console limits (contract §1.2).
const (
	DefaultConsoleLines = 100
	MaxConsoleLines     = 10000
)

// Console returns the last lines of the serial console; empty before any output.
func (cs *Consoles) Console(id string, lines int32) (*hypervisorv1.GetVirtualMachineConsoleResponse, error) {
	mc, err := cs.table.get(id)
	if err != nil {
		return nil, err
	}
	n := int(lines)
	switch {
	case n <= 0:
		n = DefaultConsoleLines
	case n > MaxConsoleLines:
		return nil, apierr.Invalidf("lines", "lines %d is above the maximum of %d", n, MaxConsoleLines)
	}
	rec, _ := mc.snapshot()
	return &hypervisorv1.GetVirtualMachineConsoleResponse{Id: id, Lines: int32(n), Console: logtail.Lines(rec.GetPaths().GetConsole(), n)}, nil
}

// Metrics summarises what the host sees of a VM.
func (ax *Access) Metrics(id string) (*hypervisorv1.VirtualMachineMetrics, error) {
	mc, err := ax.table.get(id)
	if err != nil {
		return nil, err
	}
	rec, _ := mc.snapshot()
	h := &hypervisorv1.HostMetrics{State: rec.GetState(), DiskBytes: diskBytes(rec.GetPaths().GetDir()), Network: ax.netMetrics(rec)}
	h.Attestation = gate.Summary(rec.GetRequireAttestation(), rec.GetAttestation())
	if pid := rec.GetProcesses().GetQemu().GetPid(); pid > 0 {
		h.Pid = proto.Int32(pid)
		if st, err := proc.ReadStat(int(pid)); err == nil {
			h.CpuSeconds = proto.Float64(st.CPUSeconds)
			h.MemoryRssBytes = proto.Int64(st.RSSBytes)
		}
	}
	if in := rec.GetInstalledAt(); in != nil {
		h.InstallSeconds = proto.Float64(in.AsTime().Sub(rec.GetCreatedAt().AsTime()).Seconds())
	}
	if ready, booted := rec.GetReadyAt(), rec.GetBootedAt(); ready != nil && booted != nil {
		h.BootToReadySeconds = proto.Float64(ready.AsTime().Sub(booted.AsTime()).Seconds())
	}
	h.BootPhases = rec.GetBootPhases()
	out := &hypervisorv1.VirtualMachineMetrics{Id: id, Host: h, RawReportUrl: "/api/v1/vms/" + id + "/report"}
	out.Guest, out.Note = ax.guest.Summary(rec)
	return out, nil
}

// diskBytes is the space the VM's files take (sparse disks count what is allocated).
func diskBytes(dir string) int64 {
	var total int64
	_ = filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return nil
		}
		if fi, err := d.Info(); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				total += st.Blocks * 512
			}
		}
		return nil
	})
	return total
}
