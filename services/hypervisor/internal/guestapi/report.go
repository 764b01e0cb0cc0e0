package guestapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"os"
	"regexp"
	"strings"
	"time"
	"unicode"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/imdswire"
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
	// DefaultGuestSeriesLimit is --metrics-guest-series-limit's default.
	DefaultGuestSeriesLimit = 1000
)

// Why a report entry was not exported (vm_guest_report_series_dropped_total's
// reason label).
const (
	dropLimit       = "limit"
	dropUnsupported = "unsupported"
	dropDuplicate   = "duplicate"
)

// dropReasons are the reasons, in the order they are reported.
var dropReasons = []string{dropLimit, dropUnsupported, dropDuplicate}

// reservedSeries are the per-VM names the guest collector exports itself; a
// guest family that maps onto one is unsupported.
var reservedSeries = map[string]bool{
	"report_age_seconds": true, "report_series": true, "reports_total": true, "report_series_dropped_total": true,
}

// reportTimestamps are the forms a report's timestamp comes in: RFC 3339,
// and systemd's FORMAT_TIMESTAMP_STYLE UTC.
var reportTimestamps = []string{time.RFC3339Nano, "Mon 2006-01-02 15:04:05 MST", "Mon 2006-01-02 15:04:05.999999 MST"}

// guestReport is one upload, parsed once when it arrives (or, after a
// restart, when first asked for): the series to export and what was dropped.
type guestReport struct {
	receivedAt  time.Time
	generatedAt time.Time // zero when the report has none that parses
	families    int
	entries     int
	series      []*hypervisorv1.GuestSeries
	sample      []*hypervisorv1.MetricSample
	dropped     map[string]uint64
}

var errNotReport = errors.New("not a systemd-report")

// labelName is what a field name must be after snake-casing.
var labelName = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

// parseReport reads an upload: entries become series named and typed as
// contract §10 says, at most limit of them; the rest are counted by reason.
func parseReport(b []byte, receivedAt time.Time, limit int) (*guestReport, error) {
	var rep imdswire.Report
	d := json.NewDecoder(bytes.NewReader(b))
	d.UseNumber() // counters above 2^53 keep their digits until the float
	if err := d.Decode(&rep); err != nil || rep.Metrics == nil {
		return nil, errNotReport
	}
	g := &guestReport{receivedAt: receivedAt, entries: len(rep.Metrics), dropped: map[string]uint64{}}
	for _, layout := range reportTimestamps {
		if t, err := time.Parse(layout, rep.Timestamp); err == nil {
			g.generatedAt = t
			break
		}
	}
	types := map[string]string{}
	for _, f := range rep.Describe {
		if _, ok := types[f.Name]; !ok {
			types[f.Name] = f.Type
		}
	}
	families := map[string]bool{}
	seen := map[string]bool{}
	kinds := map[string]hypervisorv1.GuestSeriesType{} // exported name -> type, one per name
	for _, e := range rep.Metrics {
		families[e.Name] = true
		s, ok := toSeries(e, types[e.Name])
		if !ok {
			g.dropped[dropUnsupported]++
			continue
		}
		if k, ok := kinds[s.GetName()]; ok && k != s.GetType() {
			g.dropped[dropUnsupported]++ // e.g. a string family "x" beside a gauge "x_info"
			continue
		}
		key := seriesKey(s)
		if seen[key] {
			g.dropped[dropDuplicate]++
			continue
		}
		if len(g.series) >= limit {
			g.dropped[dropLimit]++
			continue
		}
		seen[key] = true
		kinds[s.GetName()] = s.GetType()
		g.series = append(g.series, s)
		if len(g.sample) < maxSamples {
			v, _ := structpb.NewValue(jsonValue(e.Value))
			g.sample = append(g.sample, &hypervisorv1.MetricSample{Name: e.Name, Object: e.Object, Fields: stringFields(e.Fields), Value: v})
		}
	}
	g.families = len(families)
	return g, nil
}

// toSeries names and types one entry; false when it cannot be exported.
func toSeries(e imdswire.ReportMetric, described string) (*hypervisorv1.GuestSeries, bool) {
	family := snakeCase(e.Name)
	if family == "" {
		return nil, false
	}
	s := &hypervisorv1.GuestSeries{Object: e.Object}
	switch v := e.Value.(type) {
	case json.Number:
		f, err := v.Float64()
		if err != nil || math.IsNaN(f) || described == imdswire.FamilyString {
			return nil, false
		}
		s.Value = f
		s.Type = hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_GAUGE
		if described == imdswire.FamilyCounter {
			if f < 0 {
				return nil, false
			}
			s.Type = hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_COUNTER
		}
	case bool:
		if described == imdswire.FamilyString || described == imdswire.FamilyCounter {
			return nil, false
		}
		s.Type = hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_GAUGE
		if v {
			s.Value = 1
		}
	case string:
		if described == imdswire.FamilyCounter || described == imdswire.FamilyGauge {
			return nil, false
		}
		s.Type = hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_INFO
		s.Value, s.Info = 1, v
	default: // null, lists and objects have no sample form
		return nil, false
	}
	switch s.Type {
	case hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_COUNTER:
		if !strings.HasSuffix(family, "_total") {
			family += "_total"
		}
	case hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_INFO:
		family += "_info"
	}
	if reservedSeries[family] {
		return nil, false
	}
	s.Name = family
	for k, v := range stringFields(e.Fields) {
		name := snakeCase(k)
		if !labelName.MatchString(name) || strings.HasPrefix(name, "__") || name == "vm" || name == "object" ||
			(name == "value" && s.Type == hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_INFO) {
			return nil, false
		}
		if _, dup := s.Labels[name]; dup { // "periodA" and "period_a"
			return nil, false
		}
		if s.Labels == nil {
			s.Labels = map[string]string{}
		}
		s.Labels[name] = v
	}
	return s, true
}

// snakeCase turns a family or field name into Prometheus form:
// "io.systemd.Manager.units_by_type_total" -> "io_systemd_manager_units_by_type_total",
// "LoadAverage" -> "load_average", "HTTPRequests" -> "http_requests".
func snakeCase(name string) string {
	rs := []rune(name)
	var b strings.Builder
	for i, r := range rs {
		switch {
		case r < unicode.MaxASCII && unicode.IsUpper(r):
			prevLowerOrDigit := i > 0 && (unicode.IsLower(rs[i-1]) || unicode.IsDigit(rs[i-1]))
			nextLower := i > 0 && unicode.IsUpper(rs[i-1]) && i+1 < len(rs) && unicode.IsLower(rs[i+1])
			if prevLowerOrDigit || nextLower {
				b.WriteByte('_')
			}
			b.WriteRune(unicode.ToLower(r))
		case r >= 'a' && r <= 'z', r >= '0' && r <= '9':
			b.WriteRune(r)
		default:
			b.WriteByte('_')
		}
	}
	// Collapse runs of '_' and trim them at the ends.
	parts := strings.FieldsFunc(b.String(), func(r rune) bool { return r == '_' })
	return strings.Join(parts, "_")
}

// seriesKey identifies a series: name, object and labels (json.Marshal sorts keys).
func seriesKey(s *hypervisorv1.GuestSeries) string {
	l, _ := json.Marshal(s.GetLabels())
	return s.GetName() + "\x00" + s.GetObject() + "\x00" + string(l) + "\x00" + s.GetInfo()
}

// jsonValue turns the decoder's json.Number back into a float64 for structpb.
func jsonValue(v any) any {
	if n, ok := v.(json.Number); ok {
		f, _ := n.Float64()
		return f
	}
	return v
}

// summary is the guest part of a metrics answer (contract §1.4).
func (g *guestReport) summary(now time.Time) *hypervisorv1.GuestMetrics {
	out := &hypervisorv1.GuestMetrics{
		ReceivedAt:       timestamppb.New(g.receivedAt),
		ReportAgeSeconds: now.Sub(g.receivedAt).Seconds(),
		Families:         int32(g.families),
		Series:           int32(g.entries),
		SeriesExported:   int32(len(g.series)),
		Sample:           g.sample,
	}
	if !g.generatedAt.IsZero() {
		out.GeneratedAt = timestamppb.New(g.generatedAt)
	}
	for _, n := range g.dropped {
		out.SeriesDropped += int32(n)
	}
	return out
}

// readReport parses the upload kept at path; nil and a note when there is
// none, or when it is not a systemd-report. Its chain of error checks has
// the shape of swtpm's CA creation; kept: Go's error idiom over different
// calls, nothing to share.
func readReport(path string, limit int) (*guestReport, string) {
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
	g, err := parseReport(b, fi.ModTime(), limit)
	if err != nil {
		return nil, noteNotReport
	}
	return g, ""
}

func stringFields(f map[string]any) map[string]string {
	if len(f) == 0 {
		return nil
	}
	out := make(map[string]string, len(f))
	for k, v := range f {
		switch v := v.(type) {
		case string:
			out[k] = v
		case json.Number:
			out[k] = v.String()
		default:
			b, _ := json.Marshal(v)
			out[k] = string(b)
		}
	}
	return out
}
