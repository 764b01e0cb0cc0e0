package vm

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

func TestGuestMetrics(t *testing.T) {
	dir := t.TempDir()
	if g, note := guestMetrics("", time.Now()); g != nil || note != noteNoReport {
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
	g, note := guestMetrics(path, time.Now())
	if g == nil || note != "" {
		t.Fatalf("report: %v %q", g, note)
	}
	if g.GetFamilies() != 4 || g.GetSeries() != 6 || g.GetSeriesExported() != 4 || g.GetSeriesDropped() != 2 {
		t.Fatalf("counts: families %d series %d exported %d dropped %d", g.GetFamilies(), g.GetSeries(), g.GetSeriesExported(), g.GetSeriesDropped())
	}
	if got := g.GetGeneratedAt().AsTime(); !got.Equal(time.Date(2026, 11, 30, 1, 2, 3, 0, time.UTC)) {
		t.Fatalf("generated_at = %v", got)
	}
	if s := g.GetSample()[3]; s.GetObject() != "initrd" || s.GetValue().GetStringValue() != "verified" {
		t.Fatalf("sample = %v", s)
	}
	if s := g.GetSample()[1]; s.GetFields()["period"] != "1m" || s.GetValue().GetNumberValue() != 0.1 {
		t.Fatalf("sample = %v", s)
	}

	os.WriteFile(path, []byte(`{"mediaType":"application/vnd.io.systemd.report","timestamp":"Mon 2026-11-30 01:02:03 UTC","metrics":[]}`), 0o600)
	if g, _ := guestMetrics(path, time.Now()); g == nil || g.GetGeneratedAt() == nil || g.GetSeries() != 0 {
		t.Fatalf("systemd timestamp: %v", g)
	}
	os.WriteFile(path, []byte(`{"anything":"else"}`), 0o600)
	if g, note := guestMetrics(path, time.Now()); g != nil || note != noteNotReport {
		t.Fatalf("not a report: %v %q", g, note)
	}
}
