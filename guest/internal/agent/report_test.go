package agent

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/guest/internal/imdsclient"
	"github.com/giantswarm/vm-manager/guest/internal/sysext"
	"github.com/giantswarm/vm-manager/guest/internal/version"
)

// fakeProc is a /proc with the files the report reads.
func fakeProc(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for name, content := range map[string]string{
		"uptime":  "1234.56 4321.00\n",
		"loadavg": "0.52 0.25 0.10 1/123 4567\n",
		"meminfo": "MemTotal:        2014500 kB\nMemFree:         1800000 kB\nMemAvailable:    1900000 kB\nHugePages_Total:       0\n",
		"stat":    "cpu  10 0 20 300 0 0 0 0 0 0\nintr 5000 1 2\nctxt 987654\nbtime 1764470000\nprocesses 4321\nprocs_running 1\n",
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestBuildReport(t *testing.T) {
	now := time.Date(2026, 3, 4, 5, 6, 7, 0, time.FixedZone("CET", 3600))
	r, err := buildReport(fakeProc(t), now, bootResults{initrd: attestVerified, ready: attestRejected,
		sysext: sysext.Result{Version: "1.31.1", State: sysext.StateMerged}})
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	// As the host sees it: plain JSON.
	var got struct {
		MediaType string `json:"mediaType"`
		ReportID  string `json:"reportID"`
		Timestamp string `json:"timestamp"`
		Metrics   []struct {
			Name   string            `json:"name"`
			Object string            `json:"object"`
			Fields map[string]string `json:"fields"`
			Value  any               `json:"value"`
		} `json:"metrics"`
	}
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if got.MediaType != "application/vnd.io.systemd.report" || got.Timestamp != "2026-03-04T04:06:07Z" {
		t.Errorf("header %s %s", got.MediaType, got.Timestamp)
	}
	if id, err := base64.StdEncoding.DecodeString(got.ReportID); err != nil || len(id) != 32 {
		t.Errorf("reportID %q: %d bytes, %v", got.ReportID, len(id), err)
	}
	var lines []string
	for _, m := range got.Metrics {
		line := m.Name
		if m.Object != "" {
			line += " object=" + m.Object
		}
		if p, ok := m.Fields["period"]; ok {
			line += " period=" + p
		}
		v, _ := json.Marshal(m.Value)
		lines = append(lines, line+" "+string(v))
	}
	want := []string{
		"io.vmagent.UptimeSeconds 1234.56",
		"io.vmagent.MemoryTotalBytes 2062848000",
		"io.vmagent.MemoryAvailableBytes 1945600000",
		"io.vmagent.LoadAverage period=1m 0.52",
		"io.vmagent.LoadAverage period=5m 0.25",
		"io.vmagent.LoadAverage period=15m 0.1",
		"io.vmagent.ContextSwitches 987654",
		"io.vmagent.ProcessesCreated 4321",
		`io.vmagent.Version "` + version.Version + `"`,
		`io.vmagent.Attestation object=initrd "verified"`,
		`io.vmagent.Attestation object=ready "rejected"`,
		`io.vmagent.KubernetesSysext object=1.31.1 "merged"`,
	}
	if strings.Join(lines, "\n") != strings.Join(want, "\n") {
		t.Errorf("metrics:\n%s\nwant:\n%s", strings.Join(lines, "\n"), strings.Join(want, "\n"))
	}
	// Every family sent is described, once.
	described := map[string]int{}
	for _, f := range r.Describe {
		described[f.Name]++
	}
	for _, m := range got.Metrics {
		if described[m.Name] != 1 {
			t.Errorf("family %s described %d times", m.Name, described[m.Name])
		}
	}
	// Optional parts are left out rather than sent empty.
	if bytes.Contains(b, []byte(`"object":""`)) || bytes.Contains(b, []byte(`"fields":null`)) {
		t.Errorf("empty optional fields: %s", b)
	}

	// Each report has its own ID.
	r2, _ := buildReport(fakeProc(t), now, bootResults{})
	if r2.ReportID == r.ReportID {
		t.Error("reportID repeated")
	}
}

// Without /proc there is still a report: version and attestation.
func TestBuildReportNoProc(t *testing.T) {
	r, err := buildReport(filepath.Join(t.TempDir(), "none"), time.Now(), bootResults{initrd: attestSkipped, ready: attestSkipped})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, m := range r.Metrics {
		names = append(names, m.Name+"="+m.Value.(string))
	}
	if got := strings.Join(names, " "); got != "io.vmagent.Version="+version.Version+" io.vmagent.Attestation=skipped io.vmagent.Attestation=skipped" {
		t.Errorf("metrics %s", got)
	}
}

// Reports go out at once and then periodically; a failing IMDS prints once.
func TestUploadReports(t *testing.T) {
	var mu sync.Mutex
	var bodies []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		if r.Method != "POST" || r.URL.Path != "/giantswarm/v1/report" || r.Header.Get("Content-Type") != "application/json" {
			http.Error(w, "bad request", 400)
			return
		}
		bodies = append(bodies, string(b))
		if len(bodies) <= 3 { // the first ones fail
			http.Error(w, "report not stored", 500)
			return
		}
		w.WriteHeader(204)
	}))
	defer srv.Close()
	var out bytes.Buffer
	con := NewConsole(&out) // read only after the uploader ended
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		uploadReports(ctx, con, imdsclient.New(srv.URL+"/giantswarm/v1"), fakeProc(t), bootResults{}, 5*time.Millisecond)
		close(done)
	}()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		mu.Lock()
		n := len(bodies)
		mu.Unlock()
		if n >= 5 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d reports", n)
		}
	}
	cancel()
	<-done
	mu.Lock()
	defer mu.Unlock()
	if !json.Valid([]byte(bodies[0])) || !strings.Contains(bodies[0], `"mediaType":"application/vnd.io.systemd.report"`) {
		t.Errorf("body %s", bodies[0])
	}
	if n := strings.Count(out.String(), "report upload"); n != 1 {
		t.Errorf("%d failure lines:\n%s", n, out.String())
	}
}
