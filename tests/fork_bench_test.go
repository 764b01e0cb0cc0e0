package tests

import (
	"encoding/json"
	"fmt"
	"io/fs"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/tests/cluster"
)

// BenchmarkFork measures, side by side in one run on a 512 MiB test guest
// (256 MiB of its RAM filled, as the suspend bench does): a cold create of
// the same shape (create→ready), one fork (the call with wait_for ready:
// snapshot, the fork's vTPM made, restored, reidentified, its quote
// verified), ten forks of one parent in one call, the parent's pause, and
// the disk a fork adds. It prints the target (fork→ready ≤ 2 s) as
// met or not with the floor measured. Run it with -benchtime 2x.
func BenchmarkFork(b *testing.B) {
	images := cluster.GuestImages(b, "..")
	c := cluster.Start(b, cluster.Processes, binDir, cluster.Options{ImageDir: images, Quiet: true, LearnGolden: true})
	base := "http://" + c.Addr + "/api/v1"
	b.Cleanup(func() { killVMsAt(b, base) })
	const shape = `"image":"test-guest","memory_mib":512,"cpus":1`
	post := func(path, body string) []byte {
		code, _, out := cluster.Do(b, "POST", base+path, body)
		if code != 200 && code != 201 {
			b.Fatalf("POST %s: %d %s", path, code, out)
		}
		return out
	}
	type vm struct {
		ID, State string
		Paths     struct{ Dir string }
	}
	create := func(name string) (time.Duration, vm) {
		start := time.Now()
		var v vm
		if err := json.Unmarshal(post("/vms", `{"name":"`+name+`",`+shape+`}`), &v); err != nil || v.State != "ready" {
			b.Fatalf("create %s: %+v %v", name, v, err)
		}
		return time.Since(start), v
	}
	fork := func(id string, n int) (time.Duration, float64, []vm) {
		start := time.Now()
		var r struct {
			Vms          []vm
			PauseSeconds float64
		}
		if err := json.Unmarshal(post("/vms/"+id+"/fork", fmt.Sprintf(`{"count":%d}`, n)), &r); err != nil || len(r.Vms) != n {
			b.Fatalf("fork %s ×%d: %+v %v", id, n, r, err)
		}
		for _, f := range r.Vms {
			if f.State != "ready" {
				b.Fatalf("fork %+v", f)
			}
		}
		return time.Since(start), r.PauseSeconds, r.Vms
	}
	del := func(vms ...vm) {
		for _, v := range vms {
			cluster.Do(b, "DELETE", base+"/vms/"+v.ID, "")
		}
	}
	var cold, one, ten, pause []time.Duration
	var forkBytes int64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		d, parent := create(fmt.Sprintf("parent%d", i))
		cold = append(cold, d)
		post("/vms/"+parent.ID+"/exec", fmt.Sprintf(`{"command":["/bin/sh","-c","dd if=/dev/urandom of=/fill bs=1M count=%d 2>/dev/null && sync"]}`, fillMiB))
		d, p, forks := fork(parent.ID, 1)
		one, pause = append(one, d), append(pause, time.Duration(p*float64(time.Second)))
		forkBytes = diskBytes(forks[0].Paths.Dir)
		del(forks...)
		d, _, forks = fork(parent.ID, 10)
		ten = append(ten, d)
		del(forks...)
		del(parent)
	}
	b.StopTimer()
	cd, o, t, p := median(cold), median(one), median(ten), median(pause)
	b.ReportMetric(o.Seconds(), "fork-s")
	b.ReportMetric(t.Seconds(), "ten-forks-s")
	b.ReportMetric(p.Seconds(), "parent-pause-s")
	b.ReportMetric(o.Seconds()/cd.Seconds(), "fork/cold")
	verdict := "met"
	if o > 2*time.Second {
		verdict = "NOT met"
	}
	fmt.Printf("fork of a 512 MiB test guest (%d MiB of RAM filled), median of %d: cold create→ready %.2fs; fork→ready %.2fs (%.3f× cold), ten forks of one parent in one call %.2fs (%.2fs a fork); the parent paused %.3fs; a fork adds %d KiB on disk (its RAM is in its QEMU, not on disk)\n",
		fillMiB, b.N, cd.Seconds(), o.Seconds(), o.Seconds()/cd.Seconds(), t.Seconds(), t.Seconds()/10, p.Seconds(), forkBytes>>10)
	fmt.Printf("target: fork→ready ≤ 2s: %s (%.2fs)\n", verdict, o.Seconds())
}

// diskBytes is what a directory holds on disk (allocated blocks).
func diskBytes(dir string) int64 {
	var n int64
	_ = filepath.WalkDir(dir, func(_ string, e fs.DirEntry, err error) error {
		if err == nil && !e.IsDir() {
			if fi, err := e.Info(); err == nil {
				if st, ok := fi.Sys().(*syscall.Stat_t); ok {
					n += st.Blocks * 512
				}
			}
		}
		return nil
	})
	return n
}
