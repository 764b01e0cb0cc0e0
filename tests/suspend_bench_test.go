package tests

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/tests/cluster"
)

// fillMiB is how much of the 512 MiB guest's RAM the benchmark fills with
// random data before each suspend: an idle initramfs guest is mostly zero
// pages, which QEMU does not write out.
const fillMiB = 256

// BenchmarkSuspendResume measures, side by side for one 512 MiB guest
// through the service: a cold boot (start→ready), a suspend (the call, until
// the state is on disk and the processes ended), a resume until the call
// returns (QEMU continued the guest) and until exec answers, and the ratios
// of resume to the cold boot. Run it with a fixed count: -benchtime 3x.
func BenchmarkSuspendResume(b *testing.B) {
	images := cluster.GuestImages(b, "..")
	c := cluster.Start(b, cluster.Processes, binDir, cluster.Options{ImageDir: images, Quiet: true})
	base := "http://" + c.Addr + "/api/v1"
	b.Cleanup(func() { killVMsAt(b, base) })
	post := func(path, body string, want int) []byte {
		code, _, out := cluster.Do(b, "POST", base+path, body)
		if code != want {
			b.Fatalf("POST %s: %d %s", path, code, out)
		}
		return out
	}
	var v struct {
		ID    string
		State string
		Paths struct{ Dir string }
	}
	if err := json.Unmarshal(post("/vms", `{"name":"bench","image":"test-guest","require_attestation":false,"memory_mib":512,"cpus":1}`, 201), &v); err != nil {
		b.Fatal(err)
	}
	execOK := func() bool {
		code, _, out := cluster.Do(b, "POST", base+"/vms/"+v.ID+"/exec", `{"command":["true"]}`)
		return code == 200 && json.Valid(out)
	}
	var cold, suspend, resume, resumeExec, execRunning []time.Duration
	var size int64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		post("/vms/"+v.ID+"/stop", "", 200)
		start := time.Now()
		post("/vms/"+v.ID+"/start", "", 200)
		for {
			code, _, out := cluster.Do(b, "GET", base+"/vms/"+v.ID, "")
			var g struct{ State, LastError string }
			if code != 200 || json.Unmarshal(out, &g) != nil {
				b.Fatalf("get: %d %s", code, out)
			}
			if g.State == "ready" {
				break
			}
			if time.Since(start) > bootTimeout {
				b.Fatalf("no ready after start: %+v", g)
			}
			time.Sleep(20 * time.Millisecond)
		}
		cold = append(cold, time.Since(start))
		fill := fmt.Sprintf(`{"command":["/bin/sh","-c","dd if=/dev/urandom of=/fill bs=1M count=%d 2>/dev/null && sync"]}`, fillMiB)
		post("/vms/"+v.ID+"/exec", fill, 200)
		// One exec's own latency on the running guest, for the resume-to-exec figure.
		start = time.Now()
		if !execOK() {
			b.Fatal("exec on the running guest failed")
		}
		execRunning = append(execRunning, time.Since(start))

		start = time.Now()
		post("/vms/"+v.ID+"/suspend", "", 200)
		suspend = append(suspend, time.Since(start))
		if fi, err := os.Stat(filepath.Join(v.Paths.Dir, "suspend", "state.bin")); err == nil {
			size = fi.Size()
		}

		start = time.Now()
		post("/vms/"+v.ID+"/resume", "", 200)
		resume = append(resume, time.Since(start))
		for !execOK() {
			if time.Since(start) > time.Minute {
				b.Fatal("exec did not answer within a minute of the resume")
			}
			time.Sleep(10 * time.Millisecond)
		}
		resumeExec = append(resumeExec, time.Since(start))
	}
	b.StopTimer()
	cb, s, r, re, ex := median(cold), median(suspend), median(resume), median(resumeExec), median(execRunning)
	b.ReportMetric(cb.Seconds(), "coldboot-s")
	b.ReportMetric(s.Seconds(), "suspend-s")
	b.ReportMetric(r.Seconds(), "resume-s")
	b.ReportMetric(re.Seconds(), "resume-exec-s")
	b.ReportMetric(ex.Seconds(), "exec-running-s")
	b.ReportMetric(r.Seconds()/cb.Seconds(), "resume/coldboot")
	b.ReportMetric(re.Seconds()/cb.Seconds(), "resume-exec/coldboot")
	fmt.Printf("suspend/resume of a 512 MiB guest (%d MiB filled, state file %d MiB), median of %d: cold boot %.2fs, suspend %.2fs, resume %.2fs (until exec answers %.2fs; one exec on the running guest %.2fs), resume/cold boot %.3f (until exec %.3f)\n",
		fillMiB, size>>20, b.N, cb.Seconds(), s.Seconds(), r.Seconds(), re.Seconds(), ex.Seconds(), r.Seconds()/cb.Seconds(), re.Seconds()/cb.Seconds())
}
