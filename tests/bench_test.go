package tests

import (
	"encoding/json"
	"fmt"
	"slices"
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
func BenchmarkCreateToReady(b *testing.B) {
	images := cluster.GuestImages(b, "..")
	c := cluster.Start(b, cluster.Processes, binDir, cluster.Options{ImageDir: images, Quiet: true})
	base := "http://" + c.Addr + "/api/v1"
	var service []time.Duration
	phases := map[string][]time.Duration{}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		code, _, body := cluster.Do(b, "POST", base+"/vms", fmt.Sprintf(`{"name":"bench%d","image":"test-guest","require_attestation":false,"memory_mib":512,"cpus":1}`, i))
		if code != 201 {
			b.Fatalf("create: %d %s", code, body)
		}
		service = append(service, time.Since(start))
		var v struct{ ID string }
		if err := json.Unmarshal(body, &v); err != nil {
			b.Fatal(err)
		}
		p := bootPhases(b, base, v.ID)
		for name, sec := range p {
			phases[name] = append(phases[name], time.Duration(sec*float64(time.Second)))
		}
		if code, _, body := cluster.Do(b, "POST", base+"/vms/"+v.ID+"/stop", ""); code != 200 {
			b.Fatalf("stop: %d %s", code, body)
		}
		if code, _, body := cluster.Do(b, "DELETE", base+"/vms/"+v.ID, ""); code != 204 {
			b.Fatalf("delete: %d %s", code, body)
		}
	}
	b.StopTimer()
	s := median(service)
	var guestSum []time.Duration
	for i := range service {
		guestSum = append(guestSum, phases["firmware"][i]+phases["kernel"][i]+phases["agent"][i])
	}
	g := median(guestSum)
	b.ReportMetric(s.Seconds(), "service-s")
	b.ReportMetric(g.Seconds(), "guest-s")
	b.ReportMetric(s.Seconds()/g.Seconds(), "ratio")
	fmt.Printf("create→ready, median of %d: service %.2fs, the guest's own boot (firmware+kernel+agent) %.2fs, ratio %.2f\n", b.N, s.Seconds(), g.Seconds(), s.Seconds()/g.Seconds())
	fmt.Printf("phases, medians (s):")
	for _, name := range phaseNames {
		fmt.Printf(" %s %.2f", name, median(phases[name]).Seconds())
	}
	fmt.Printf("; launch→ready %.2f\n", median(phases["total"]).Seconds())
	// CPU time does not stretch when other work shares the cores, as the
	// phases' wall time does under TCG: it compares firmware or device
	// changes on a busy machine.
	fmt.Printf("QEMU's CPU time until ready, median: %.2fs\n", median(phases["qemu_cpu"]).Seconds())
	b.ReportMetric(median(phases["qemu_cpu"]).Seconds(), "qemu-cpu-s")
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
