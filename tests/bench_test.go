package tests

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/tests/cluster"
)

// BenchmarkCreateToReady compares create→ready through the service (REST,
// gateway, hypervisor, swtpm, QEMU, readiness) with the very QEMU command the
// hypervisor ran, launched directly: the ratio is the service's overhead.
// Run it with a fixed count: go test -bench CreateToReady -benchtime 5x.
func BenchmarkCreateToReady(b *testing.B) {
	images := cluster.GuestImages(b, "..")
	c := cluster.Start(b, cluster.Processes, binDir, cluster.Options{ImageDir: images, Quiet: true})
	base := "http://" + c.Addr + "/api/v1"
	var service, direct []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		code, _, body := cluster.Do(b, "POST", base+"/vms", fmt.Sprintf(`{"name":"bench%d","image":"test-guest","require_attestation":false,"memory_mib":512,"cpus":1}`, i))
		if code != 201 {
			b.Fatalf("create: %d %s", code, body)
		}
		service = append(service, time.Since(start))
		var v struct {
			ID    string
			Paths struct{ Dir, QemuLog, TpmState, NotifySocket string }
		}
		if err := json.Unmarshal(body, &v); err != nil {
			b.Fatal(err)
		}
		if code, _, body := cluster.Do(b, "POST", base+"/vms/"+v.ID+"/stop", ""); code != 200 {
			b.Fatalf("stop: %d %s", code, body)
		}
		d, err := runDirect(v.Paths.QemuLog, v.Paths.TpmState, v.Paths.NotifySocket)
		if err != nil {
			b.Fatal(err)
		}
		direct = append(direct, d)
		if code, _, body := cluster.Do(b, "DELETE", base+"/vms/"+v.ID, ""); code != 204 {
			b.Fatalf("delete: %d %s", code, body)
		}
	}
	b.StopTimer()
	s, q := median(service), median(direct)
	b.ReportMetric(s.Seconds(), "service-s")
	b.ReportMetric(q.Seconds(), "direct-s")
	b.ReportMetric(s.Seconds()/q.Seconds(), "ratio")
	fmt.Printf("create→ready, median of %d: service %.2fs, direct QEMU %.2fs, ratio %.2f\n", b.N, s.Seconds(), q.Seconds(), s.Seconds()/q.Seconds())
}

func median(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

// runDirect starts swtpm and the recorded QEMU argv by hand and times QEMU's
// start to READY=1 on the notify socket.
func runDirect(qemuLog, tpmDir, notifySock string) (time.Duration, error) {
	argv, err := lastArgv(qemuLog)
	if err != nil {
		return 0, err
	}
	ctrl := filepath.Join(tpmDir, "swtpm.sock")
	_ = os.Remove(ctrl)
	tpm := exec.Command("swtpm", "socket", "--tpm2", "--tpmstate", "dir="+tpmDir, "--ctrl", "type=unixio,path="+ctrl, "--flags", "not-need-init", "--terminate")
	if err := tpm.Start(); err != nil {
		return 0, err
	}
	defer func() { _ = tpm.Process.Kill(); _ = tpm.Wait() }()
	for i := 0; ; i++ {
		if _, err := os.Stat(ctrl); err == nil {
			break
		}
		if i > 200 {
			return 0, errors.New("swtpm socket did not appear")
		}
		time.Sleep(10 * time.Millisecond)
	}
	start := time.Now()
	q := exec.Command(argv[0], argv[1:]...)
	if err := q.Start(); err != nil {
		return 0, err
	}
	defer func() { _ = q.Process.Kill(); _ = q.Wait() }()
	deadline := time.Now().Add(3 * time.Minute)
	for time.Now().Before(deadline) {
		conn, err := net.Dial("unix", notifySock)
		if err != nil {
			time.Sleep(20 * time.Millisecond)
			continue
		}
		r := bufio.NewReader(conn)
		for {
			_ = conn.SetReadDeadline(deadline)
			msg, err := r.ReadString(0)
			if err != nil {
				conn.Close()
				return 0, fmt.Errorf("notify: %w", err)
			}
			if strings.Contains("\n"+strings.TrimSuffix(msg, "\x00")+"\n", "\nREADY=1\n") {
				conn.Close()
				return time.Since(start), nil
			}
		}
	}
	return 0, errors.New("no READY=1 within 3 minutes")
}

// lastArgv reads the argv the hypervisor logged for its last QEMU run.
func lastArgv(qemuLog string) ([]string, error) {
	b, err := os.ReadFile(qemuLog)
	if err != nil {
		return nil, err
	}
	var argv []string
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "--- "); ok {
			if i := strings.IndexByte(rest, ' '); i > 0 {
				argv = nil
				if err := json.Unmarshal([]byte(rest[i+1:]), &argv); err != nil {
					return nil, fmt.Errorf("qemu.log argv: %w", err)
				}
			}
		}
	}
	if len(argv) == 0 {
		return nil, errors.New("no argv in qemu.log")
	}
	return argv, nil
}
