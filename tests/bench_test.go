package tests

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/tests/cluster"
)

// BenchmarkCreateToReady times create→ready through the service (REST,
// gateway, hypervisor, swtpm, QEMU, network, IMDS, readiness) and sets it
// beside the guest's own part of it: its firmware, kernel and vm-agent
// phases, which the hypervisor reads from the guest's console at READY=1
// (GET /vms/{id}/metrics, host.boot_phases). What the service adds is the
// rest; the ratio is create→ready over the guest's part. The phase table
// is the medians of each phase. Run it with a fixed count:
// go test -bench CreateToReady -benchtime 5x.
//
// With VMM_BENCH_BASELINE_OVMF=<code>,<vars> a second cluster runs that
// firmware pair, and each iteration creates a VM on both, alternating
// which goes first: a firmware change compared in one run, under the same
// load (docs/performance.md#create-to-ready).
func BenchmarkCreateToReady(b *testing.B) {
	images := cluster.GuestImages(b, "..")
	runs := []*benchSeries{{name: "service"}}
	if pair := os.Getenv("VMM_BENCH_BASELINE_OVMF"); pair != "" {
		code, vars, ok := strings.Cut(pair, ",")
		if !ok {
			b.Fatalf("VMM_BENCH_BASELINE_OVMF=%q: want <code>,<vars>", pair)
		}
		runs = append(runs, &benchSeries{name: "baseline firmware " + filepath.Base(code),
			env: []string{"VM_MANAGER_OVMF_CODE=" + code, "VM_MANAGER_OVMF_VARS=" + vars}})
	}
	for _, r := range runs {
		c := cluster.Start(b, cluster.Processes, binDir, cluster.Options{ImageDir: images, Quiet: true, Env: r.env})
		r.base = "http://" + c.Addr + "/api/v1"
		r.phases = map[string][]time.Duration{}
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := range runs {
			runs[(i+j)%len(runs)].createToReady(b, i)
		}
	}
	b.StopTimer()
	for k, r := range runs {
		s, g, cpu := r.report(b.N)
		if k == 0 {
			b.ReportMetric(s.Seconds(), "service-s")
			b.ReportMetric(g.Seconds(), "guest-s")
			b.ReportMetric(s.Seconds()/g.Seconds(), "ratio")
			b.ReportMetric(cpu.Seconds(), "qemu-cpu-s")
		}
	}
}

// benchSeries is one cluster's VMs.
type benchSeries struct {
	name    string
	env     []string
	base    string
	service []time.Duration
	phases  map[string][]time.Duration
}

// createToReady creates one VM, waits for ready, reads its phases, and
// deletes it.
func (r *benchSeries) createToReady(b *testing.B, i int) {
	start := time.Now()
	code, _, body := cluster.Do(b, "POST", r.base+"/vms", fmt.Sprintf(`{"name":"bench%d","image":"test-guest","require_attestation":false,"memory_mib":512,"cpus":1}`, i))
	if code != 201 {
		b.Fatalf("create: %d %s", code, body)
	}
	r.service = append(r.service, time.Since(start))
	var v struct{ ID string }
	if err := json.Unmarshal(body, &v); err != nil {
		b.Fatal(err)
	}
	for name, sec := range bootPhases(b, r.base, v.ID) {
		r.phases[name] = append(r.phases[name], time.Duration(sec*float64(time.Second)))
	}
	if code, _, body := cluster.Do(b, "POST", r.base+"/vms/"+v.ID+"/stop", ""); code != 200 {
		b.Fatalf("stop: %d %s", code, body)
	}
	if code, _, body := cluster.Do(b, "DELETE", r.base+"/vms/"+v.ID, ""); code != 204 {
		b.Fatalf("delete: %d %s", code, body)
	}
}

// report prints the series' medians: create→ready, the guest's own boot,
// QEMU's CPU time.
func (r *benchSeries) report(n int) (service, guest, cpu time.Duration) {
	var guestSum []time.Duration
	for i := range r.service {
		guestSum = append(guestSum, r.phases["firmware"][i]+r.phases["kernel"][i]+r.phases["agent"][i])
	}
	s, g := median(r.service), median(guestSum)
	fmt.Printf("%s: create→ready, median of %d: %.2fs, the guest's own boot (firmware+kernel+agent) %.2fs, ratio %.2f\n", r.name, n, s.Seconds(), g.Seconds(), s.Seconds()/g.Seconds())
	fmt.Printf("%s: phases, medians (s):", r.name)
	for _, name := range phaseNames {
		fmt.Printf(" %s %.2f", name, median(r.phases[name]).Seconds())
	}
	fmt.Printf("; launch→ready %.2f\n", median(r.phases["total"]).Seconds())
	// CPU time does not stretch when other work shares the cores, as the
	// phases' wall time does under TCG: it compares firmware or device
	// changes on a busy machine.
	c := median(r.phases["qemu_cpu"])
	fmt.Printf("%s: QEMU's CPU time until ready, median: %.2fs\n", r.name, c.Seconds())
	return s, g, c
}

// phaseNames are host.boot_phases' keys without _seconds, in launch order.
var phaseNames = []string{"provision", "register", "swtpm", "qemu", "firmware", "kernel", "agent"}

// bootPhases reads a ready VM's boot phases; each must be there.
func bootPhases(b *testing.B, base, id string) map[string]float64 {
	code, _, body := cluster.Do(b, "GET", base+"/vms/"+id+"/metrics", "")
	if code != 200 {
		b.Fatalf("metrics: %d %s", code, body)
	}
	var m struct {
		Host struct {
			BootPhases map[string]float64 `json:"boot_phases"`
			CPUSeconds *float64           `json:"cpu_seconds"`
		}
	}
	if err := json.Unmarshal(body, &m); err != nil {
		b.Fatal(err)
	}
	out := map[string]float64{}
	for _, name := range append(slices.Clone(phaseNames), "total") {
		v, ok := m.Host.BootPhases[name+"_seconds"]
		if !ok {
			b.Fatalf("metrics of %s: no boot_phases.%s_seconds in %s", id, name, body)
		}
		out[name] = v
	}
	if m.Host.CPUSeconds == nil {
		b.Fatalf("metrics of %s: no cpu_seconds in %s", id, body)
	}
	out["qemu_cpu"] = *m.Host.CPUSeconds
	return out
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}
