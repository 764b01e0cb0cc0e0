package guestapi

import (
	"regexp"
	"testing"
	"time"
	"unicode/utf8"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
)

var (
	// The name after the gateway's vm_guest_ prefix.
	metricName = regexp.MustCompile(`^[a-z0-9_]+$`)
	promLabel  = regexp.MustCompile(`^[a-zA-Z_][a-zA-Z0-9_]*$`)
)

// A guest's report upload is hostile input that ends up in the gateway's
// Prometheus exposition: whatever the guest sends, parseReport does not
// panic, exports at most the limit, only valid metric and label names, one
// type per name, no series twice, and accounts for every entry.
func FuzzGuestReport(f *testing.F) {
	f.Add([]byte(`{"mediaType":"application/vnd.io.systemd.report","timestamp":"2026-11-30T01:02:03Z","metrics":[
	 {"name":"io.vmagent.UptimeSeconds","value":12.5},
	 {"name":"io.vmagent.LoadAverage","fields":{"period":"1m"},"value":0.1},
	 {"name":"io.vmagent.Attestation","object":"initrd","value":"verified"},
	 {"name":"io.vmagent.ContextSwitches","value":18446744073709551615}],
	 "describe":[{"name":"io.vmagent.ContextSwitches","type":"counter"}]}`), 3)
	f.Add([]byte(`{"metrics":[{"name":"X","value":"s"},{"name":"x_info","value":1},{"name":"x","fields":{"Value":"v","value":"w"},"value":"s"}]}`), 10)
	f.Add([]byte(`{"metrics":[{"name":"report.AgeSeconds","value":1},{"name":"a","fields":{"1":"x","__x":"y"},"value":true},{"name":"a","value":null}]}`), 1)
	f.Add([]byte(`{"metrics":[{"name":"\u00e9\u00e9","value":1e400},{"name":"n","value":-0}]}`), 5)
	f.Add([]byte(`not json`), 1)
	f.Fuzz(func(t *testing.T, body []byte, limit int) {
		if limit < 1 || limit > 2000 {
			limit = 1 + (limit%2000+2000)%2000
		}
		g, err := parseReport(body, time.Unix(0, 0), limit)
		if err != nil {
			return
		}
		if len(g.series) > limit {
			t.Fatalf("%d series exported, limit %d", len(g.series), limit)
		}
		var dropped uint64
		for _, n := range g.dropped {
			dropped += n
		}
		if uint64(len(g.series))+dropped != uint64(g.entries) {
			t.Fatalf("%d exported + %d dropped != %d entries", len(g.series), dropped, g.entries)
		}
		types := map[string]hypervisorv1.GuestSeriesType{}
		seen := map[string]bool{}
		for _, s := range g.series {
			if !metricName.MatchString(s.GetName()) || !promLabel.MatchString("vm_guest_"+s.GetName()) || reservedSeries[s.GetName()] {
				t.Fatalf("metric name %q", s.GetName())
			}
			if t0, ok := types[s.GetName()]; ok && t0 != s.GetType() {
				t.Fatalf("%s exported as %v and %v", s.GetName(), t0, s.GetType())
			}
			types[s.GetName()] = s.GetType()
			for k, v := range s.GetLabels() {
				if !promLabel.MatchString(k) || k == "vm" || k == "object" || len(k) > 1 && k[:2] == "__" {
					t.Fatalf("label name %q", k)
				}
				if k == "value" && s.GetType() == hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_INFO {
					t.Fatalf("label value beside an info value")
				}
				if !utf8.ValidString(v) {
					t.Fatalf("invalid UTF-8 label value %q", v)
				}
			}
			if s.GetType() == hypervisorv1.GuestSeriesType_GUEST_SERIES_TYPE_COUNTER && s.GetValue() < 0 {
				t.Fatalf("negative counter %v", s)
			}
			key := seriesKey(s)
			if seen[key] {
				t.Fatalf("series %q twice", key)
			}
			seen[key] = true
			for _, str := range []string{s.GetObject(), s.GetInfo()} {
				if !utf8.ValidString(str) {
					t.Fatalf("invalid UTF-8 %q", str)
				}
			}
		}
	})
}
