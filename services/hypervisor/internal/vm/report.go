package vm

import (
	"encoding/json"
	"os"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Notes of a metrics answer (contract §1.4).
const (
	noteNoReport  = "no systemd-report upload from the guest yet; host metrics only"
	noteNotReport = "the guest's last upload is not a systemd-report and was not exported; see raw_report_url"
	// maxSamples is how many report entries a metrics answer shows; the
	// whole upload is at raw_report_url.
	maxSamples = 50
)

// systemdReport is the upload of `systemd-report upload` (and of vm-agent):
// {mediaType, reportID, timestamp, metrics:[{name, object?, fields?, value}]}.
type systemdReport struct {
	Timestamp string         `json:"timestamp"`
	Metrics   []reportMetric `json:"metrics"`
}

type reportMetric struct {
	Name   string          `json:"name"`
	Object string          `json:"object,omitempty"`
	Fields map[string]any  `json:"fields,omitempty"`
	Value  json.RawMessage `json:"value"`
}

// reportTimestamps are the forms a report's timestamp comes in: RFC 3339,
// and systemd's FORMAT_TIMESTAMP_STYLE UTC.
var reportTimestamps = []string{time.RFC3339Nano, "Mon 2006-01-02 15:04:05 MST", "Mon 2006-01-02 15:04:05.999999 MST"}

// guestMetrics summarises the guest's last upload at path: nil and a note
// when there is none, or when it is not a systemd-report.
func guestMetrics(path string, now time.Time) (*hypervisorv1.GuestMetrics, string) {
	if path == "" {
		return nil, noteNoReport
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, noteNoReport
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, noteNoReport
	}
	var rep systemdReport
	if err := json.Unmarshal(b, &rep); err != nil || rep.Metrics == nil {
		return nil, noteNotReport
	}
	g := &hypervisorv1.GuestMetrics{
		ReceivedAt:       timestamppb.New(fi.ModTime()),
		ReportAgeSeconds: now.Sub(fi.ModTime()).Seconds(),
		Series:           int32(len(rep.Metrics)),
	}
	for _, layout := range reportTimestamps {
		if t, err := time.Parse(layout, rep.Timestamp); err == nil {
			g.GeneratedAt = timestamppb.New(t)
			break
		}
	}
	families := map[string]bool{}
	seen := map[string]bool{}
	for _, e := range rep.Metrics {
		families[e.Name] = true
		v := &structpb.Value{}
		key := e.Name + "\x00" + e.Object + "\x00" + fieldsKey(e.Fields)
		switch {
		case e.Name == "" || v.UnmarshalJSON(e.Value) != nil:
			g.SeriesDropped++
			continue
		case seen[key]:
			g.SeriesDropped++ // a duplicate series
			continue
		}
		switch v.GetKind().(type) {
		case *structpb.Value_NumberValue, *structpb.Value_StringValue, *structpb.Value_BoolValue:
		default:
			g.SeriesDropped++ // lists, objects and null have no sample form
			continue
		}
		seen[key] = true
		g.SeriesExported++
		if len(g.Sample) < maxSamples {
			g.Sample = append(g.Sample, &hypervisorv1.MetricSample{Name: e.Name, Object: e.Object, Fields: stringFields(e.Fields), Value: v})
		}
	}
	g.Families = int32(len(families))
	return g, ""
}

func stringFields(f map[string]any) map[string]string {
	if len(f) == 0 {
		return nil
	}
	out := make(map[string]string, len(f))
	for k, v := range f {
		if s, ok := v.(string); ok {
			out[k] = s
		} else {
			b, _ := json.Marshal(v)
			out[k] = string(b)
		}
	}
	return out
}

// fieldsKey identifies a field set (json.Marshal sorts map keys).
func fieldsKey(f map[string]any) string {
	b, _ := json.Marshal(stringFields(f))
	return string(b)
}
