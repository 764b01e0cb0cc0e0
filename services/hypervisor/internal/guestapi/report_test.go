package guestapi

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
)

func TestGuestMetricsSummary(t *testing.T) {
	dir := t.TempDir()
	if g, note := readReport("", DefaultGuestSeriesLimit); g != nil || note != noteNoReport {
		t.Fatalf("no path: %v %q", g, note)
	}
	path := filepath.Join(dir, "report.json")
	os.WriteFile(path, []byte(`{"mediaType":"application/vnd.io.systemd.report","timestamp":"2026-11-30T01:02:03Z","metrics":[
	 {"name":"io.vmagent.UptimeSeconds","value":12.5},
	 {"name":"io.vmagent.LoadAverage","fields":{"period":"1m"},"value":0.1},
	 {"name":"io.vmagent.LoadAverage","fields":{"period":"5m"},"value":0.2},
	 {"name":"io.vmagent.LoadAverage","fields":{"period":"5m"},"value":0.3},
	 {"name":"io.vmagent.Attestation","object":"initrd","value":"verified"},
	 {"name":"io.vmagent.Nested","value":{"a":1}}]}`), 0o600)
	g, note := readReport(path, DefaultGuestSeriesLimit)
	if g == nil || note != "" {
		t.Fatalf("report: %v %q", g, note)
	}
	s := g.summary(time.Now())
	if s.GetFamilies() != 4 || s.GetSeries() != 6 || s.GetSeriesExported() != 4 || s.GetSeriesDropped() != 2 {
		t.Fatalf("counts: families %d series %d exported %d dropped %d", s.GetFamilies(), s.GetSeries(), s.GetSeriesExported(), s.GetSeriesDropped())
	}
	if got := s.GetGeneratedAt().AsTime(); !got.Equal(time.Date(2026, 11, 30, 1, 2, 3, 0, time.UTC)) {
		t.Fatalf("generated_at = %v", got)
	}
	if x := s.GetSample()[3]; x.GetObject() != "initrd" || x.GetValue().GetStringValue() != "verified" {
		t.Fatalf("sample = %v", x)
	}
	if x := s.GetSample()[1]; x.GetFields()["period"] != "1m" || x.GetValue().GetNumberValue() != 0.1 {
		t.Fatalf("sample = %v", x)
	}

	os.WriteFile(path, []byte(`{"mediaType":"application/vnd.io.systemd.report","timestamp":"Mon 2026-11-30 01:02:03 UTC","metrics":[]}`), 0o600)
	if g, _ := readReport(path, DefaultGuestSeriesLimit); g == nil || g.summary(time.Now()).GetGeneratedAt() == nil || g.entries != 0 {
		t.Fatalf("systemd timestamp: %v", g)
	}
	os.WriteFile(path, []byte(`{"anything":"else"}`), 0o600)
	if g, note := readReport(path, DefaultGuestSeriesLimit); g != nil || note != noteNotReport {
		t.Fatalf("not a report: %v %q", g, note)
	}
}

// series prints exported series as Prometheus would name them (without the
// vm_guest_ prefix and the vm label).
func series(g *guestReport) []string {
	var out []string
	for _, s := range g.series {
		var labels []string
		if s.GetObject() != "" {
			labels = append(labels, "object="+s.GetObject())
		}
		for k, v := range s.GetLabels() {
			labels = append(labels, k+"="+v)
		}
		if s.GetType() == hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_INFO {
			labels = append(labels, "value="+s.GetInfo())
		}
		slices.Sort(labels)
		out = append(out, fmt.Sprintf("%s{%s} %g %s", s.GetName(), strings.Join(labels, ","), s.GetValue(),
			strings.ToLower(strings.TrimPrefix(s.GetType().String(), "GUEST_SERIES_TYPE_"))))
	}
	return out
}

func TestGuestSeriesNamesAndTypes(t *testing.T) {
	body := `{"timestamp":"2026-11-30T01:02:03Z","metrics":[
	 {"name":"io.vmagent.UptimeSeconds","value":12.5},
	 {"name":"io.vmagent.ContextSwitches","value":18446744073709551615},
	 {"name":"io.systemd.Manager.units_by_type_total","fields":{"type":"service"},"value":42},
	 {"name":"io.vmagent.Attestation","object":"initrd","value":"verified"},
	 {"name":"io.vmagent.Healthy","value":true},
	 {"name":"io.vmagent.LoadAverage","fields":{"Period":"1m","cpu":3},"value":0.5},
	 {"name":"io.vmagent.LoadAverage","fields":{"period":"1m","cpu":"3"},"value":0.6},
	 {"name":"","value":1},
	 {"name":"...","value":1},
	 {"name":"io.vmagent.Null","value":null},
	 {"name":"io.vmagent.List","value":[1]},
	 {"name":"io.vmagent.BadLabel","fields":{"1x":"a"},"value":1},
	 {"name":"io.vmagent.VMLabel","fields":{"vm":"other"},"value":1},
	 {"name":"io.vmagent.ObjectLabel","fields":{"Object":"x"},"value":1},
	 {"name":"io.vmagent.Version","fields":{"value":"x"},"value":"1.0"},
	 {"name":"io.vmagent.ContextSwitches","value":"many"},
	 {"name":"io.vmagent.Negative","value":-1},
	 {"name":"report.AgeSeconds","value":1},
	 {"name":"io.vmagent.X","value":"s"},
	 {"name":"io.vmagent.X_info","value":2}
	],"describe":[
	 {"name":"io.vmagent.ContextSwitches","type":"counter"},
	 {"name":"io.systemd.Manager.units_by_type_total","type":"counter"},
	 {"name":"io.vmagent.Negative","type":"counter"}
	]}`
	g, err := parseReport([]byte(body), time.Now(), DefaultGuestSeriesLimit)
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"io_vmagent_uptime_seconds{} 12.5 gauge",
		"io_vmagent_context_switches_total{} 1.8446744073709552e+19 counter",
		"io_systemd_manager_units_by_type_total{type=service} 42 counter",
		"io_vmagent_attestation_info{object=initrd,value=verified} 1 info",
		"io_vmagent_healthy{} 1 gauge",
		"io_vmagent_load_average{cpu=3,period=1m} 0.5 gauge",
		"io_vmagent_x_info{value=s} 1 info",
	}
	if got := series(g); !slices.Equal(got, want) {
		t.Errorf("series:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	// The second LoadAverage is the first again once its fields are labels;
	// the rest of the tail cannot be exported as they are.
	wantDropped := map[string]uint64{dropDuplicate: 1, dropUnsupported: 12}
	if !mapsEqual(g.dropped, wantDropped) {
		t.Errorf("dropped %v, want %v", g.dropped, wantDropped)
	}
	if g.families != 18 || g.entries != 20 {
		t.Errorf("families %d entries %d", g.families, g.entries)
	}
}

func mapsEqual(a, b map[string]uint64) bool {
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	for k, v := range b {
		if a[k] != v {
			return false
		}
	}
	return true
}

func TestGuestSeriesLimit(t *testing.T) {
	var entries []string
	for i := range 10 {
		entries = append(entries, fmt.Sprintf(`{"name":"io.x.Gauge","fields":{"n":"%d"},"value":%d}`, i, i))
	}
	entries = append(entries, `{"name":"io.x.Gauge","fields":{"n":"0"},"value":0}`, `{"name":"io.x.Bad","value":{}}`)
	g, err := parseReport([]byte(`{"metrics":[`+strings.Join(entries, ",")+`]}`), time.Now(), 4)
	if err != nil {
		t.Fatal(err)
	}
	if len(g.series) != 4 || g.series[3].GetLabels()["n"] != "3" {
		t.Errorf("series %v", series(g))
	}
	if want := map[string]uint64{dropLimit: 6, dropDuplicate: 1, dropUnsupported: 1}; !mapsEqual(g.dropped, want) {
		t.Errorf("dropped %v, want %v", g.dropped, want)
	}
}

func TestSnakeCase(t *testing.T) {
	for in, want := range map[string]string{
		"io.vmagent.LoadAverage":                 "io_vmagent_load_average",
		"io.systemd.Manager.units_by_type_total": "io_systemd_manager_units_by_type_total",
		"HTTPRequests":                           "http_requests",
		"cpu0Seconds":                            "cpu0_seconds",
		"a--b..c":                                "a_b_c",
		"_x_":                                    "x",
		"ünïcode":                                "n_code",
		"":                                       "",
	} {
		if got := snakeCase(in); got != want {
			t.Errorf("snakeCase(%q) = %q, want %q", in, got, want)
		}
	}
}

// Uploads count, and their drops add up, per VM; a VM's series are those of
// its last upload, also after a restart (read back from report.json).
func TestStoreReportCounts(t *testing.T) {
	s, _ := newSide(t, nil)
	s.cfg.SeriesLimit = 2
	report := `{"metrics":[{"name":"a","value":1},{"name":"b","value":2},{"name":"c","value":3},{"name":"a","value":1}]}`
	for range 2 {
		if err := s.StoreReport(vmID, []byte(report)); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.StoreReport(vmID, []byte(`"not a report"`)); err != nil {
		t.Fatal(err)
	}
	all := s.GuestSeries()
	if len(all) != 1 {
		t.Fatalf("%d vms", len(all))
	}
	vs := all[0]
	if vs.GetReportsTotal() != 3 || len(vs.GetSeries()) != 0 || vs.GetReceivedAt() != nil {
		t.Errorf("after a non-report upload: %v", vs)
	}
	if want := map[string]uint64{dropLimit: 2, dropDuplicate: 2, dropUnsupported: 0}; !mapsEqual(vs.GetSeriesDroppedTotal(), want) {
		t.Errorf("dropped %v, want %v", vs.GetSeriesDroppedTotal(), want)
	}
	if err := s.StoreReport(vmID, []byte(report)); err != nil {
		t.Fatal(err)
	}
	if vs := s.GuestSeries()[0]; len(vs.GetSeries()) != 2 || vs.GetEntries() != 4 || vs.GetReceivedAt() == nil {
		t.Errorf("after a report: %v", vs)
	}
	// A restarted hypervisor has no counts yet but the same series.
	s.reports = map[string]*reportState{}
	if vs := s.GuestSeries()[0]; len(vs.GetSeries()) != 2 || vs.GetReportsTotal() != 0 {
		t.Errorf("after a restart: %v", vs)
	}
}
