package agent

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/giantswarm/vm-manager/guest/internal/attest"
	"github.com/giantswarm/vm-manager/guest/internal/imdsclient"
	"github.com/giantswarm/vm-manager/guest/internal/sysext"
	"github.com/giantswarm/vm-manager/guest/internal/version"
	"github.com/giantswarm/vm-manager/pkg/imdswire"
)

// ReportInterval is how often the report is sent again after the first one.
const ReportInterval = 15 * time.Second

// Report is the body of POST /report, in systemd-report's upload format.
type Report = imdswire.Report

// Metric is one entry of a Report; Value is a number or a string.
type Metric = imdswire.ReportMetric

// families describes what buildReport sends, as io.systemd.Metrics.Describe
// would; the host exports counters with _total and strings as _info.
var families = []imdswire.ReportFamily{
	{Name: "io.vmagent.UptimeSeconds", Type: imdswire.FamilyGauge, Description: "Seconds since the guest booted."},
	{Name: "io.vmagent.MemoryTotalBytes", Type: imdswire.FamilyGauge, Description: "Usable memory."},
	{Name: "io.vmagent.MemoryAvailableBytes", Type: imdswire.FamilyGauge, Description: "Memory available for new work."},
	{Name: "io.vmagent.LoadAverage", Type: imdswire.FamilyGauge, Description: "Load average over period."},
	{Name: "io.vmagent.ContextSwitches", Type: imdswire.FamilyCounter, Description: "Context switches since boot."},
	{Name: "io.vmagent.ProcessesCreated", Type: imdswire.FamilyCounter, Description: "Processes and threads created since boot."},
	{Name: "io.vmagent.Version", Type: imdswire.FamilyString, Description: "The vm-agent version."},
	{Name: "io.vmagent.Attestation", Type: imdswire.FamilyString, Description: "How the attestation stage (object) of this boot ended."},
	{Name: "io.vmagent.KubernetesSysext", Type: imdswire.FamilyString, Description: "How the Kubernetes system extension of the version (object) ended: merged, mismatch, refused or failed."},
}

// bootResults is how the attestation stages and the Kubernetes sysext of
// this boot ended.
type bootResults struct {
	initrd, ready attestResult
	sysext        sysext.Result
}

func (r attestResult) String() string {
	switch r {
	case attestVerified:
		return "verified"
	case attestRejected:
		return "rejected"
	case attestFailed:
		return "failed"
	}
	return "skipped"
}

// buildReport reads the metrics from proc (/proc at boot). A source that cannot be
// read leaves its metrics out: a partial report is still worth sending.
func buildReport(proc string, now time.Time, att bootResults) (*Report, error) {
	id := make([]byte, 32)
	if _, err := rand.Read(id); err != nil {
		return nil, err
	}
	r := &Report{
		MediaType: imdswire.ReportMediaType,
		ReportID:  base64.StdEncoding.EncodeToString(id),
		Timestamp: now.UTC().Format(time.RFC3339),
	}
	add := func(name string, v any) { r.Metrics = append(r.Metrics, Metric{Name: name, Value: v}) }

	if f := procFields(proc, "uptime"); len(f) >= 1 {
		if v, err := strconv.ParseFloat(f[0], 64); err == nil {
			add("io.vmagent.UptimeSeconds", v)
		}
	}
	mem := meminfo(proc)
	if v, ok := mem["MemTotal"]; ok {
		add("io.vmagent.MemoryTotalBytes", v)
	}
	if v, ok := mem["MemAvailable"]; ok {
		add("io.vmagent.MemoryAvailableBytes", v)
	}
	if f := procFields(proc, "loadavg"); len(f) >= 3 {
		for i, period := range []string{"1m", "5m", "15m"} {
			if v, err := strconv.ParseFloat(f[i], 64); err == nil {
				r.Metrics = append(r.Metrics, Metric{Name: "io.vmagent.LoadAverage", Fields: map[string]any{"period": period}, Value: v})
			}
		}
	}
	stat := procStat(proc)
	if v, ok := stat["ctxt"]; ok {
		add("io.vmagent.ContextSwitches", v)
	}
	if v, ok := stat["processes"]; ok {
		add("io.vmagent.ProcessesCreated", v)
	}
	add("io.vmagent.Version", version.Version)
	r.Metrics = append(r.Metrics,
		Metric{Name: "io.vmagent.Attestation", Object: attest.StageInitrd, Value: att.initrd.String()},
		Metric{Name: "io.vmagent.Attestation", Object: attest.StageReady, Value: att.ready.String()})
	if v := att.sysext.Version; v != "" {
		r.Metrics = append(r.Metrics, Metric{Name: "io.vmagent.KubernetesSysext", Object: v, Value: att.sysext.State})
	}
	r.Describe = families
	return r, nil
}

// procText is the text of the file name under proc (/proc); empty when it
// cannot be read, so that its metrics are left out.
func procText(proc, name string) string {
	b, err := os.ReadFile(filepath.Join(proc, name))
	if err != nil {
		return ""
	}
	return string(b)
}

func procFields(proc, name string) []string {
	return strings.Fields(procText(proc, name))
}

// procStat reads /proc/stat's single-number lines ("ctxt 123").
func procStat(proc string) map[string]uint64 {
	m := map[string]uint64{}
	for _, line := range strings.Split(procText(proc, "stat"), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		if n, err := strconv.ParseUint(f[1], 10, 64); err == nil {
			m[f[0]] = n
		}
	}
	return m
}

// meminfo reads /proc/meminfo's "<Key>: <n> kB" lines as bytes.
func meminfo(proc string) map[string]uint64 {
	m := map[string]uint64{}
	for _, line := range strings.Split(procText(proc, "meminfo"), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		n, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			continue
		}
		if len(f) > 1 && f[1] == "kB" {
			n *= 1024
		}
		m[k] = n
	}
	return m
}

// uploadReports sends a report at once and then every interval until ctx ends. The
// host may not take reports (yet): failures only print, the first one.
func uploadReports(ctx context.Context, con *Console, cl *imdsclient.Client, proc string, att bootResults, interval time.Duration) {
	failed := false
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		err := uploadReport(ctx, cl, proc, att)
		if err != nil && !failed && ctx.Err() == nil {
			failed = true
			con.Printf("warning: report upload: %v (further failures are not printed)", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func uploadReport(ctx context.Context, cl *imdsclient.Client, proc string, att bootResults) error {
	r, err := buildReport(proc, time.Now(), att)
	if err != nil {
		return err
	}
	body, err := json.Marshal(r)
	if err != nil {
		return err
	}
	return cl.PostReport(ctx, body)
}
