package tests

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/enumname"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// Load test knobs (make test-load passes them through).
const (
	loadDefaultClients  = 200
	loadDefaultDuration = 60 * time.Second
	// loadRSSBound is how much a process's resident set may grow from before
	// the load (after warm-up) to 10 s after it.
	loadRSSBound = 100 << 20
	// loadCallTimeout bounds each call: one slower than this is an error.
	loadCallTimeout = 30 * time.Second
)

var loadSurfaces = []string{"REST", "gRPC", "MCP"}
var loadOps = []string{"list_vms", "get_vm", "get_host"}

// loadCaller is one client's way to make the three calls.
type loadCaller interface {
	call(ctx context.Context, op, vmID string) (body string, err error)
}

// TestLoad runs LOAD_CLIENTS (200) concurrent clients for LOAD_DURATION
// (60 s) against the three real binaries while two test guests run: each
// client is bound to one surface (REST, gRPC through the gateway, MCP with a
// session of its own) and loops over a random mix of list_vms, get_vm and
// get_host. Every call must succeed with a correct answer; it prints p50,
// p99 and calls/s per surface and the processes' RSS before, right after and
// 10 s after the load, and fails when a process grew by more than 100 MiB or
// a VM is no longer ready. Skipped unless LOAD=1: make test-load.
func TestLoad(t *testing.T) {
	if os.Getenv("LOAD") != "1" {
		t.Skip("load test: 200 clients for 60 s against the three binaries; run it with make test-load (LOAD=1)")
	}
	clients := loadDefaultClients
	if v := os.Getenv("LOAD_CLIENTS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("LOAD_CLIENTS=%q: want a positive integer", v)
		}
		clients = n
	}
	duration := loadDefaultDuration
	if v := os.Getenv("LOAD_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("LOAD_DURATION=%q: want a positive duration", v)
		}
		duration = d
	}
	images := cluster.GuestImages(t, "..")
	// Info level, as deployed: the services log no line per request there.
	// The logs go to files, counted below.
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, LogLevel: "info", Quiet: true})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })
	t.Cleanup(func() {
		if t.Failed() {
			dumpLogs(t, c.Dir, 60)
		}
	})

	// Two ready guests: their records are what get_vm and list_vms read.
	vms := make([]vmJSON, 2)
	var wg sync.WaitGroup
	for i := range vms {
		wg.Go(func() {
			vms[i] = a.vm("POST", "/vms", fmt.Sprintf(`{"name":"load%d","image":"test-guest","require_attestation":false,"memory_mib":384,"cpus":1}`, i), 201)
		})
	}
	wg.Wait()
	for _, v := range vms {
		if v.State != "ready" {
			t.Fatalf("%s: %s %s", v.Name, v.State, v.LastError)
		}
	}
	ids := []string{vms[0].ID, vms[1].ID}

	var host struct {
		Qemu, Swtpm struct{ Version string }
		Firmware    struct{ Sha256 string }
	}
	getJSON(t, a.base+"/host", &host)
	if host.Qemu.Version == "" || host.Swtpm.Version == "" || host.Firmware.Sha256 == "" {
		t.Fatalf("host report before the load: %+v", host)
	}
	want := loadWant{ids: ids, qemu: host.Qemu.Version, swtpm: host.Swtpm.Version, firmware: host.Firmware.Sha256}

	// Shared client plumbing: one HTTP transport for REST and MCP with room
	// for every client's connection (MCP sessions hold a second one each for
	// their standalone SSE stream), one gRPC connection for all gRPC clients,
	// as an SDK user would have.
	transport := &http.Transport{MaxIdleConns: 4 * clients, MaxIdleConnsPerHost: 4 * clients, IdleConnTimeout: time.Minute}
	defer transport.CloseIdleConnections()
	httpClient := &http.Client{Transport: transport}
	gconn, err := grpc.NewClient(c.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer gconn.Close()
	hv := hypervisorv1.NewHypervisorServiceClient(gconn)

	ctx, cancel := context.WithTimeout(context.Background(), duration+10*time.Minute)
	defer cancel()

	// Surfaces are dealt round-robin after a shuffle, so each gets a third.
	surfaceOf := make([]int, clients)
	for i := range surfaceOf {
		surfaceOf[i] = i % len(loadSurfaces)
	}
	rand.Shuffle(len(surfaceOf), func(i, j int) { surfaceOf[i], surfaceOf[j] = surfaceOf[j], surfaceOf[i] })
	callers := make([]loadCaller, clients)
	var sessions []*mcp.ClientSession
	var connectErr error
	var mu sync.Mutex
	sem := make(chan struct{}, 20)
	for i := range callers {
		switch loadSurfaces[surfaceOf[i]] {
		case "REST":
			callers[i] = restCaller{client: httpClient, base: a.base}
		case "gRPC":
			callers[i] = grpcCaller{hv: hv}
		case "MCP":
			wg.Go(func() {
				sem <- struct{}{}
				defer func() { <-sem }()
				cs, err := mcp.NewClient(&mcp.Implementation{Name: "vmm-load", Version: "0"}, nil).
					Connect(ctx, &mcp.StreamableClientTransport{Endpoint: "http://" + c.Addr + "/mcp", HTTPClient: httpClient}, nil)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					connectErr = err
					return
				}
				sessions = append(sessions, cs)
				callers[i] = mcpCaller{cs: cs}
			})
		}
	}
	wg.Wait()
	defer func() {
		for _, cs := range sessions {
			_ = cs.Close()
		}
	}()
	if connectErr != nil {
		t.Fatalf("mcp connect: %v", connectErr)
	}

	// Warm-up: every client makes each call once, checked like the rest.
	var warmErr error
	for i := range callers {
		wg.Go(func() {
			for _, op := range loadOps {
				if err := want.check(ctx, callers[i], op, ids[i%2]); err != nil {
					mu.Lock()
					warmErr = fmt.Errorf("%s %s: %w", loadSurfaces[surfaceOf[i]], op, err)
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	if warmErr != nil {
		t.Fatalf("warm-up: %v", warmErr)
	}
	pids := map[string]int{}
	for _, s := range cluster.Services {
		pids[s] = c.Pid(s)
	}
	rssBefore := rssOf(t, pids)
	logsBefore := logLines(c.Dir)

	// The load.
	type sample struct {
		lat  []time.Duration
		err  []string
		nerr int
	}
	results := make([]sample, clients)
	var errCount atomic.Int64
	start := time.Now()
	deadline := start.Add(duration)
	for i := range callers {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(uint64(i), uint64(start.UnixNano())))
			s := &results[i]
			for time.Now().Before(deadline) {
				op := loadOps[r.IntN(len(loadOps))]
				id := ids[r.IntN(len(ids))]
				t0 := time.Now()
				err := want.check(ctx, callers[i], op, id)
				s.lat = append(s.lat, time.Since(t0))
				if err != nil {
					errCount.Add(1)
					s.nerr++
					if len(s.err) < 3 {
						s.err = append(s.err, fmt.Sprintf("%s %s (after %s): %v", loadSurfaces[surfaceOf[i]], op, time.Since(start).Round(time.Millisecond), err))
					}
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	rssAfter := rssOf(t, pids)
	logsDuring := logLines(c.Dir) - logsBefore
	for _, cs := range sessions {
		_ = cs.Close()
	}
	sessions = nil
	transport.CloseIdleConnections()
	time.Sleep(10 * time.Second)
	rssIdle := rssOf(t, pids)

	// The table.
	var sb strings.Builder
	fmt.Fprintf(&sb, "load: %d clients for %s (%s measured) on %d CPUs, 2 ready VMs, list_vms/get_vm/get_host at random\n", clients, duration, elapsed.Round(time.Millisecond), runtime.NumCPU())
	fmt.Fprintf(&sb, "  %-6s %8s %8s %9s %10s %10s %10s %10s\n", "surface", "clients", "calls", "errors", "calls/s", "p50", "p99", "max")
	var all []time.Duration
	var total int
	for si, name := range loadSurfaces {
		var lat []time.Duration
		n, errs := 0, 0
		for i := range results {
			if surfaceOf[i] != si {
				continue
			}
			n++
			lat = append(lat, results[i].lat...)
			errs += results[i].nerr
		}
		all = append(all, lat...)
		total += len(lat)
		if len(lat) == 0 {
			fmt.Fprintf(&sb, "  %-6s %8d %8d\n", name, n, 0)
			continue
		}
		fmt.Fprintf(&sb, "  %-6s %8d %8d %9d %10.0f %10s %10s %10s\n", name, n, len(lat), errs, float64(len(lat))/elapsed.Seconds(),
			fmtLat(quantile(lat, 0.5)), fmtLat(quantile(lat, 0.99)), fmtLat(slices.Max(lat)))
	}
	fmt.Fprintf(&sb, "  %-6s %8d %8d %9d %10.0f %10s %10s %10s\n", "all", clients, total, errCount.Load(), float64(total)/elapsed.Seconds(),
		fmtLat(quantile(all, 0.5)), fmtLat(quantile(all, 0.99)), fmtLat(slices.Max(all)))
	fmt.Fprintf(&sb, "  %-12s %12s %12s %16s\n", "process", "RSS before", "RSS after", "RSS after 10 s")
	for _, s := range cluster.Services {
		fmt.Fprintf(&sb, "  %-12s %10.1f M %10.1f M %14.1f M\n", s, mib(rssBefore[s]), mib(rssAfter[s]), mib(rssIdle[s]))
	}
	fmt.Fprintf(&sb, "  log lines written by the three processes during the load: %d\n", logsDuring)
	t.Log("\n" + sb.String())
	fmt.Print(sb.String())

	if n := errCount.Load(); n > 0 {
		var first []string
		for _, r := range results {
			first = append(first, r.err...)
			if len(first) >= 10 {
				break
			}
		}
		t.Errorf("%d of %d calls failed; the first ones:\n  %s", n, total, strings.Join(first[:min(10, len(first))], "\n  "))
	}
	for _, s := range cluster.Services {
		if grew := rssIdle[s] - rssBefore[s]; grew > loadRSSBound {
			t.Errorf("%s: RSS grew by %.1f MiB (%.1f -> %.1f MiB 10 s after the load), bound %d MiB", s, mib(grew), mib(rssBefore[s]), mib(rssIdle[s]), loadRSSBound>>20)
		}
	}
	// Info level logs no line per request: a few hundred thousand calls
	// must not have written more than a handful of lines.
	if logsDuring > 50 {
		t.Errorf("the services wrote %d log lines during the load at info level: per-request logging?", logsDuring)
	}
	for _, v := range vms {
		now := a.get(v.ID)
		if now.State != "ready" || now.Processes == nil || now.Processes.Qemu.Pid != v.Processes.Qemu.Pid {
			t.Errorf("%s after the load: state %s, processes %+v (qemu pid was %d), lastError %q", v.Name, now.State, now.Processes, v.Processes.Qemu.Pid, now.LastError)
		}
	}
	if r := a.exec(vms[0].ID, "hostname"); r.Stdout != "load0\n" {
		t.Errorf("exec after the load: %+v", r)
	}
}

// loadWant checks an answer: the right VM, both VMs listed, the host report
// with the same tools and firmware as before the load.
type loadWant struct {
	ids                   []string
	qemu, swtpm, firmware string
}

func (w loadWant) check(ctx context.Context, c loadCaller, op, id string) error {
	ctx, cancel := context.WithTimeout(ctx, loadCallTimeout)
	defer cancel()
	body, err := c.call(ctx, op, id)
	if err != nil {
		return err
	}
	switch op {
	case "get_vm":
		var v struct{ ID, State string }
		if err := json.Unmarshal([]byte(body), &v); err != nil {
			return fmt.Errorf("%v: %.200s", err, body)
		}
		if v.ID != id || v.State != "ready" {
			return fmt.Errorf("vm %s in state %q, want %s ready", v.ID, v.State, id)
		}
	case "list_vms":
		var list []struct{ ID string }
		if err := json.Unmarshal([]byte(body), &list); err != nil {
			return fmt.Errorf("%v: %.200s", err, body)
		}
		var got []string
		for _, v := range list {
			got = append(got, v.ID)
		}
		slices.Sort(got)
		if exp := slices.Sorted(slices.Values(w.ids)); !slices.Equal(got, exp) {
			return fmt.Errorf("listed %v, want %v", got, exp)
		}
	case "get_host":
		var h struct {
			Qemu, Swtpm struct{ Version, Error string }
			Firmware    struct{ Sha256, Error string }
		}
		if err := json.Unmarshal([]byte(body), &h); err != nil {
			return fmt.Errorf("%v: %.200s", err, body)
		}
		if h.Qemu.Version != w.qemu || h.Swtpm.Version != w.swtpm || h.Firmware.Sha256 != w.firmware {
			return fmt.Errorf("host report differs from before the load: qemu %q (%s), swtpm %q (%s), firmware %q (%s)",
				h.Qemu.Version, h.Qemu.Error, h.Swtpm.Version, h.Swtpm.Error, h.Firmware.Sha256, h.Firmware.Error)
		}
	}
	return nil
}

type restCaller struct {
	client *http.Client
	base   string
}

func (r restCaller) call(ctx context.Context, op, id string) (string, error) {
	path := map[string]string{"list_vms": "/vms", "get_vm": "/vms/" + id, "get_host": "/host"}[op]
	req, err := http.NewRequestWithContext(ctx, "GET", r.base+path, nil)
	if err != nil {
		return "", err
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("status %d: %.300s", resp.StatusCode, b)
	}
	return string(b), nil
}

type grpcCaller struct {
	hv hypervisorv1.HypervisorServiceClient
}

// call answers in the REST JSON's shape, the fields check reads.
func (g grpcCaller) call(ctx context.Context, op, id string) (string, error) {
	var out any
	switch op {
	case "list_vms":
		r, err := g.hv.ListVirtualMachines(ctx, &hypervisorv1.ListVirtualMachinesRequest{})
		if err != nil {
			return "", err
		}
		list := []map[string]string{}
		for _, v := range r.GetVms() {
			list = append(list, map[string]string{"id": v.GetId()})
		}
		out = list
	case "get_vm":
		v, err := g.hv.GetVirtualMachine(ctx, &hypervisorv1.GetVirtualMachineRequest{Id: id})
		if err != nil {
			return "", err
		}
		out = map[string]string{"id": v.GetId(), "state": enumname.Of(v.GetState())}
	case "get_host":
		h, err := g.hv.GetHost(ctx, &hypervisorv1.GetHostRequest{})
		if err != nil {
			return "", err
		}
		out = map[string]any{
			"qemu":     map[string]string{"version": h.GetQemu().GetVersion(), "error": h.GetQemu().GetError()},
			"swtpm":    map[string]string{"version": h.GetSwtpm().GetVersion(), "error": h.GetSwtpm().GetError()},
			"firmware": map[string]string{"sha256": h.GetFirmware().GetSha256(), "error": h.GetFirmware().GetError()},
		}
	}
	b, err := json.Marshal(out)
	return string(b), err
}

type mcpCaller struct{ cs *mcp.ClientSession }

func (m mcpCaller) call(ctx context.Context, op, id string) (string, error) {
	args := map[string]any{}
	if op == "get_vm" {
		args["id"] = id
	}
	res, err := m.cs.CallTool(ctx, &mcp.CallToolParams{Name: op, Arguments: args})
	if err != nil {
		return "", err
	}
	text := mcpText(res)
	if res.IsError {
		return "", fmt.Errorf("tool error: %.300s", text)
	}
	return text, nil
}

// rssOf reads VmRSS of each process in bytes.
func rssOf(t *testing.T, pids map[string]int) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	for name, pid := range pids {
		f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if rest, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
				kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(rest), "kB")), 10, 64)
				if err == nil {
					out[name] = kb << 10
				}
			}
		}
		f.Close()
		if _, ok := out[name]; !ok {
			t.Fatalf("%s (pid %d): no VmRSS", name, pid)
		}
	}
	return out
}

// logLines counts the lines of the services' log files (Options.Quiet).
func logLines(dir string) int {
	n := 0
	for _, s := range cluster.Services {
		b, _ := os.ReadFile(filepath.Join(dir, s+".log"))
		n += strings.Count(string(b), "\n")
	}
	return n
}

// dumpLogs prints the last lines of each service's log file.
func dumpLogs(t *testing.T, dir string, lines int) {
	for _, s := range cluster.Services {
		b, err := os.ReadFile(filepath.Join(dir, s+".log"))
		if err != nil {
			continue
		}
		all := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
		t.Logf("last %d lines of %s.log:\n%s", lines, s, strings.Join(all[max(0, len(all)-lines):], "\n"))
	}
}

func fmtLat(d time.Duration) string {
	switch {
	case d >= time.Second:
		return fmt.Sprintf("%.2fs", d.Seconds())
	case d >= time.Millisecond:
		return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond))
	}
	return fmt.Sprintf("%.0fµs", micros(d))
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }
