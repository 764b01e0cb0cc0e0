package tests

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/giantswarm/vm-manager/tests/cluster"
)

// TestDBFaults runs the real binaries against database faults: a disk that
// fills while a record is written, damaged database files, and a state
// directory another process holds.
func TestDBFaults(t *testing.T) {
	t.Run("full disk", testFullDisk)
	t.Run("damaged files", testDamagedDBs)
	t.Run("locked state directory", testLockedStateDir)
}

// lockPid is the PID a service wrote into <state>/<name>.lock.
func lockPid(t *testing.T, stateDir, name string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(stateDir, name+".lock"))
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("%s.lock: %q", name, b)
	}
	return pid
}

// setFileSizeLimit sets RLIMIT_FSIZE of a running process (prlimit(2)).
func setFileSizeLimit(pid int, limit uint64) error {
	var old syscall.Rlimit
	if _, _, e := syscall.RawSyscall6(syscall.SYS_PRLIMIT64, uintptr(pid), syscall.RLIMIT_FSIZE, 0, uintptr(unsafe.Pointer(&old)), 0, 0); e != 0 {
		return e
	}
	lim := syscall.Rlimit{Cur: limit, Max: old.Max}
	if _, _, e := syscall.RawSyscall6(syscall.SYS_PRLIMIT64, uintptr(pid), syscall.RLIMIT_FSIZE, uintptr(unsafe.Pointer(&lim)), 0, 0, 0); e != 0 {
		return e
	}
	return nil
}

// bigEgress is the largest egress policy a network may have (64 rules of 64
// ports): a record of about 13 KB, so a few make the database file grow.
func bigEgress(seed int) []map[string]any {
	rules := make([]map[string]any, 64)
	for i := range rules {
		ports := make([]int, 64)
		for j := range ports {
			ports[j] = 1000 + (seed%14)*4096 + i*64 + j
		}
		rules[i] = map[string]any{"cidr": fmt.Sprintf("10.%d.%d.0/24", 200+seed%50, i), "ports": ports}
	}
	return rules
}

// testFullDisk gives the running hypervisor a file-size limit just above its
// database (prlimit(2) RLIMIT_FSIZE; the Go runtime catches SIGXFSZ and drops
// it, so a write past the limit fails with EFBIG as on a full disk), creates
// networks until one fails, then restarts it without the limit: every
// acknowledged network is intact, the refused one does not exist.
func testFullDisk(t *testing.T) {
	images := t.TempDir()
	writeCatalog(t, images)
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, Quiet: true})
	api := "http://" + c.Addr + "/api/v1"
	pid := lockPid(t, c.StateDir, "hypervisor")
	dbPath := filepath.Join(c.StateDir, "hypervisor.db")
	fi, err := os.Stat(dbPath)
	if err != nil {
		t.Fatal(err)
	}
	limit := uint64(fi.Size()) + 64<<10
	if err := setFileSizeLimit(pid, limit); err != nil {
		t.Fatalf("prlimit: %v", err)
	}
	t.Logf("hypervisor.db is %d bytes; RLIMIT_FSIZE of pid %d set to %d", fi.Size(), pid, limit)

	type created struct {
		name string
		body []byte // the 201 response
	}
	var acked []created
	failed := ""
	for i := 0; i < 40 && failed == ""; i++ {
		name := fmt.Sprintf("full-%02d", i)
		req, _ := json.Marshal(map[string]any{"name": name, "cidr": fmt.Sprintf("10.100.%d.0/24", i), "egress": bigEgress(i)})
		code, _, b := cluster.Do(t, "POST", api+"/networks", string(req))
		switch code {
		case http.StatusCreated:
			acked = append(acked, created{name, b})
		case http.StatusInternalServerError, http.StatusServiceUnavailable:
			var e envelope
			if err := json.Unmarshal(b, &e); err != nil || (e.Error.Code != "internal_error" && e.Error.Code != "unavailable") {
				t.Fatalf("create %s: %d %s, want the error envelope with internal_error or unavailable", name, code, b)
			}
			t.Logf("create %s after %d networks: %d %s: %s", name, len(acked), code, e.Error.Code, e.Error.Message)
			failed = name
		default:
			t.Fatalf("create %s: %d %s", name, code, b)
		}
	}
	if failed == "" {
		t.Fatalf("40 networks fit under a %d-byte file size limit", limit)
	}
	if len(acked) == 0 {
		t.Logf("the first network already failed: the check below only covers the default network")
	}
	// The hypervisor lives on, refusing writes; reads work.
	c.WaitReady(10 * time.Second)
	expectError(t, "GET", api+"/networks/"+failed, "", 404, "not_found")
	code, _, b := cluster.Do(t, "POST", api+"/networks", `{"name":"after-full","cidr":"10.101.0.0/24","egress":`+mustJSON(bigEgress(41))+`}`)
	if code != http.StatusInternalServerError && code != http.StatusServiceUnavailable {
		t.Errorf("another create on the full disk: %d %s", code, b)
	}
	size, _ := os.Stat(dbPath)
	if uint64(size.Size()) > limit {
		t.Errorf("hypervisor.db is %d bytes, above the %d limit", size.Size(), limit)
	}

	// Restart without the limit (SIGKILL: nothing gets flushed on the way out).
	c.StopService("hypervisor")
	c.StartService("hypervisor")
	c.WaitReady(30 * time.Second)
	for _, n := range acked {
		code, _, b := cluster.Do(t, "GET", api+"/networks/"+n.name, "")
		if code != 200 {
			t.Errorf("acknowledged network %s after the restart: %d %s", n.name, code, b)
			continue
		}
		var want, got struct{ Spec, Gateway, CreatedBy any }
		_ = json.Unmarshal(n.body, &want)
		_ = json.Unmarshal(b, &got)
		if mustJSON(want) != mustJSON(got) {
			t.Errorf("network %s changed across the restart:\n%s\n%s", n.name, n.body, b)
		}
	}
	for _, gone := range []string{failed, "after-full"} {
		expectError(t, "GET", api+"/networks/"+gone, "", 404, "not_found")
	}
	// The disk has room again: the refused network can be created now.
	req, _ := json.Marshal(map[string]any{"name": failed, "cidr": "10.102.0.0/24", "egress": bigEgress(42)})
	if code, _, b := cluster.Do(t, "POST", api+"/networks", string(req)); code != http.StatusCreated {
		t.Errorf("create %s once the disk has room: %d %s", failed, code, b)
	}
	t.Logf("%d acknowledged networks intact after the restart", len(acked))
}

func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return string(b)
}

// serveBinary runs vmm-<name> serve on stateDir with its own run directory
// and returns its combined output and exit code; a process still running
// after wait is killed and reported as -1 (it started).
func serveBinary(t *testing.T, name, stateDir, imageDir string, wait time.Duration) (string, int) {
	t.Helper()
	runDir, err := os.MkdirTemp("", "vmm-run-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(runDir)
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(binDir, "vmm-"+name), "serve")
	cmd.Env = append(os.Environ(),
		"VM_MANAGER_STATE_DIR="+stateDir,
		"VM_MANAGER_RUN_DIR="+runDir,
		"VM_MANAGER_IMAGE_DIR="+imageDir,
		"VM_MANAGER_LOG_LEVEL=info",
		"VM_MANAGER_OIDC_ISSUER=",
	)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err = cmd.Run()
	if ctx.Err() != nil {
		return out.String(), -1
	}
	if err != nil && cmd.ProcessState == nil {
		t.Fatalf("run vmm-%s: %v", name, err)
	}
	return out.String(), cmd.ProcessState.ExitCode()
}

// startsAndServes runs vmm-<name> serve until its socket answers, then
// stops it: the harness's proof that a refusal is the file's doing.
func startsAndServes(t *testing.T, name, stateDir, imageDir string) {
	t.Helper()
	runDir, err := os.MkdirTemp("", "vmm-run-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(runDir)
	cmd := exec.Command(filepath.Join(binDir, "vmm-"+name), "serve")
	cmd.Env = append(os.Environ(), "VM_MANAGER_STATE_DIR="+stateDir, "VM_MANAGER_RUN_DIR="+runDir, "VM_MANAGER_IMAGE_DIR="+imageDir, "VM_MANAGER_LOG_LEVEL=warn", "VM_MANAGER_OIDC_ISSUER=")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	defer func() { _ = cmd.Process.Signal(syscall.SIGTERM); <-done }()
	sock := filepath.Join(runDir, name+".sock")
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-done:
			t.Fatalf("vmm-%s with the healthy file exited: %s", name, out.String())
		default:
		}
		if conn, err := net.Dial("unix", sock); err == nil {
			conn.Close()
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("vmm-%s with the healthy file did not serve within 30s: %s", name, out.String())
}

// testDamagedDBs damages hypervisor.db and attestation.db written by the
// real services: each damaged file is refused at start with an error naming
// it, and left byte for byte as it was.
func testDamagedDBs(t *testing.T) {
	images := t.TempDir()
	writeCatalog(t, images)
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, Quiet: true})
	api := "http://" + c.Addr + "/api/v1"
	for i := range 3 {
		body := fmt.Sprintf(`{"name":"keep-%d","cidr":"10.60.%d.0/24","egress":%s}`, i, i, mustJSON(bigEgress(i)))
		if code, _, b := cluster.Do(t, "POST", api+"/networks", body); code != http.StatusCreated {
			t.Fatalf("create network: %d %s", code, b)
		}
	}
	policy := `{"golden":{"sha256":{"0":"` + strings.Repeat("ab", 32) + `"}}}`
	if code, _, b := cluster.Do(t, "PUT", api+"/images/test-guest_1.0.0/policy", policy); code != 200 {
		t.Fatalf("import policy: %d %s", code, b)
	}
	c.StopAll()

	page := os.Getpagesize()
	for _, svc := range []string{"hypervisor", "attestation"} {
		path := filepath.Join(c.StateDir, svc+".db")
		orig, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		garbage := make([]byte, len(orig))
		for i := range garbage {
			garbage[i] = byte(i*131 + 7)
		}
		flip := func(offs ...int) []byte {
			b := bytes.Clone(orig)
			for _, o := range offs {
				b[o] ^= 0x5a
			}
			return b
		}
		for _, tc := range []struct {
			name string
			data []byte
		}{
			{"truncated to half", orig[:len(orig)/2]},
			{"meta page 0 flipped", flip(16+20, 16+41)},
			{"meta page 1 flipped", flip(page+16+20, page+16+41)},
			{"both meta pages flipped", flip(16+20, page+16+20)},
			{"garbage", garbage},
		} {
			t.Run(svc+"/"+tc.name, func(t *testing.T) {
				if err := os.WriteFile(path, tc.data, 0o600); err != nil {
					t.Fatal(err)
				}
				out, code := serveBinary(t, svc, c.StateDir, images, 30*time.Second)
				if code == -1 {
					t.Fatalf("vmm-%s started on a damaged %s.db: %s", svc, svc, out)
				}
				if code == 0 || !strings.Contains(out, path) || !strings.Contains(out, "damaged") || strings.Contains(out, "panic") {
					t.Errorf("exit %d, want a clear refusal naming %s:\n%s", code, path, out)
				}
				after, err := os.ReadFile(path)
				if err != nil || !bytes.Equal(after, tc.data) {
					t.Errorf("%s.db was modified (%v)", svc, err)
				}
				t.Logf("exit %d: %s", code, lastLine(out))
			})
		}
		// The same start with the file as it was serves.
		if err := os.WriteFile(path, orig, 0o600); err != nil {
			t.Fatal(err)
		}
		startsAndServes(t, svc, c.StateDir, images)
	}
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// testLockedStateDir starts a second hypervisor and attestation on the state
// directory of running ones: each refuses at once, naming the holder's PID,
// and leaves the lock as it was.
func testLockedStateDir(t *testing.T) {
	images := t.TempDir()
	writeCatalog(t, images)
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, Quiet: true})
	for _, svc := range []string{"hypervisor", "attestation"} {
		t.Run(svc, func(t *testing.T) {
			lock := filepath.Join(c.StateDir, svc+".lock")
			before, err := os.ReadFile(lock)
			if err != nil {
				t.Fatal(err)
			}
			holder := lockPid(t, c.StateDir, svc)
			exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", holder))
			if filepath.Base(exe) != "vmm-"+svc {
				t.Fatalf("the lock names pid %d, which is %q", holder, exe)
			}
			start := time.Now()
			out, code := serveBinary(t, svc, c.StateDir, images, 20*time.Second)
			if code == -1 {
				t.Fatalf("a second vmm-%s started on a locked state directory: %s", svc, out)
			}
			want := fmt.Sprintf("locked by pid %d", holder)
			if code == 0 || !strings.Contains(out, "state directory in use") || !strings.Contains(out, want) {
				t.Errorf("exit %d, want a refusal naming %q:\n%s", code, want, out)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("the refusal took %s", d)
			}
			if after, _ := os.ReadFile(lock); !bytes.Equal(after, before) {
				t.Errorf("the lock file changed: %q → %q", before, after)
			}
			t.Logf("exit %d: %s", code, lastLine(out))
		})
	}
	c.WaitReady(10 * time.Second) // the holders never noticed
}
