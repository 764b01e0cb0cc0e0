package tests

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/tests/cluster"
)

// vmJSON is the part of the REST VM record the tests look at.
type vmJSON struct {
	ID          string `json:"id"`
	Name        string `json:"name"`
	State       string `json:"state"`
	Phase       string `json:"phase"`
	Accelerator string `json:"accelerator"`
	Network     string `json:"network"`
	IP          string `json:"ip"`
	MAC         string `json:"mac"`
	Zone        string `json:"zone"`
	LastError   string `json:"lastError"`
	Status      string `json:"status"`
	Booted      bool   `json:"booted"`
	ReadyAt     string `json:"readyAt"`
	Paths       struct {
		Dir string `json:"dir"`
	} `json:"paths"`
	Processes *struct {
		Qemu struct{ Pid int } `json:"qemu"`
		Tpm  struct{ Pid int } `json:"tpm"`
	} `json:"processes"`
}

// withPoweroffImage adds a variant of the test guest that powers itself off
// after READY=1: same kernel and initrd, another command line.
func withPoweroffImage(t testing.TB, src string) string {
	t.Helper()
	dir := t.TempDir()
	kernels, _ := filepath.Glob(filepath.Join(src, "test-guest_*.vmlinuz"))
	stem := strings.TrimSuffix(filepath.Base(kernels[0]), ".vmlinuz")
	for _, ext := range []string{".vmlinuz", ".initrd"} {
		if err := os.Symlink(filepath.Join(src, stem+ext), filepath.Join(dir, stem+ext)); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(filepath.Join(src, stem+ext), filepath.Join(dir, "oneshot-guest_1.0.0"+ext)); err != nil {
			t.Fatal(err)
		}
	}
	cmdline, _ := os.ReadFile(filepath.Join(src, stem+".cmdline"))
	if err := os.WriteFile(filepath.Join(dir, stem+".cmdline"), cmdline, 0o644); err != nil {
		t.Fatal(err)
	}
	oneshot := strings.TrimSpace(string(cmdline)) + " vm-agent.poweroff-after-ready=1s"
	if err := os.WriteFile(filepath.Join(dir, "oneshot-guest_1.0.0.cmdline"), []byte(oneshot), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

type api struct {
	t    *testing.T
	base string
}

func (a api) vm(method, path, body string, wantStatus int) vmJSON {
	a.t.Helper()
	code, _, b := cluster.Do(a.t, method, a.base+path, body)
	if code != wantStatus {
		a.t.Fatalf("%s %s: %d, want %d: %s", method, path, code, wantStatus, b)
	}
	var v vmJSON
	if len(b) > 0 {
		if err := json.Unmarshal(b, &v); err != nil {
			a.t.Fatalf("%s %s: %v", method, path, err)
		}
	}
	return v
}

func (a api) get(id string) vmJSON { return a.vm("GET", "/vms/"+id, "", 200) }

// waitState polls until the VM is in state (or fails on a terminal surprise).
func (a api) waitState(id, state string, d time.Duration) vmJSON {
	a.t.Helper()
	var v vmJSON
	cluster.Eventually(a.t, d, "vm "+id+" "+state, func() error {
		v = a.get(id)
		if v.State != state {
			return fmt.Errorf("state %s (lastError %q)", v.State, v.LastError)
		}
		return nil
	})
	return v
}

// alive is signal 0 succeeding: unlike cluster.Running, a zombie (a QEMU
// that died but is not reaped yet) counts as alive.
func alive(pid int) bool {
	if pid <= 0 {
		return false
	}
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// waitGone waits for a process to exit; QEMU may take a moment after delete returns.
func waitGone(t *testing.T, pid int, what string) {
	t.Helper()
	cluster.Eventually(t, 10*time.Second, what+" exit", func() error {
		if !cluster.Running(pid) {
			return nil
		}
		return fmt.Errorf("pid %d still running", pid)
	})
}

const bootTimeout = 3 * time.Minute

// TestVMLifecycle boots the real test guest with QEMU, swtpm and OVMF through
// the three real binaries: create→ready, console, stop, start, reboot, delete,
// concurrent creates, validation, a guest powering itself off, a QEMU that
// dies, and re-adoption across a hypervisor SIGKILL.
func TestVMLifecycle(t *testing.T) {
	images := withPoweroffImage(t, cluster.GuestImages(t, ".."))
	for _, mode := range []cluster.Mode{cluster.Processes, cluster.InProcess} {
		t.Run(string(mode), func(t *testing.T) {
			c := cluster.Start(t, mode, binDir, cluster.Options{ImageDir: images})
			lifecycle(t, c)
		})
	}
}

func lifecycle(t *testing.T, c *cluster.Cluster) {
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })

	var t1 vmJSON
	t.Run("create waits for ready", func(t *testing.T) {
		a.t = t
		ignition := `{\"ignition\":{\"version\":\"3.4.0\"},\"storage\":{\"files\":[{\"path\":\"/etc/hello\",\"contents\":{\"source\":\"data:,hi\"}}]}}`
		t1 = a.vm("POST", "/vms", `{"name":"t1","image":"test-guest","require_attestation":false,"memory_mib":512,"cpus":1,"user_data":"`+ignition+`"}`, 201)
		if t1.State != "ready" || t1.Phase != "boot" || !t1.Booted || t1.ReadyAt == "" || t1.Processes == nil {
			t.Fatalf("created vm %+v", t1)
		}
		if want := hostAccelerator(t, a.base); t1.Accelerator != want {
			t.Errorf("vm accelerator %q, host report says %q", t1.Accelerator, want)
		}
		var con struct{ Console string }
		getJSON(t, a.base+"/vms/"+t1.ID+"/console?lines=200", &con)
		if !strings.Contains(con.Console, "vm-agent: ") || !strings.Contains(con.Console, "t1") {
			t.Errorf("console lacks the guest's progress:\n%s", con.Console)
		}
		// DHCP on the userspace network, the IMDS behind the gateway, user-data
		// released (attestation not required) and applied.
		for _, want := range []string{"vm-agent: dhcp " + t1.IP + "/24 via 192.168.127.1", "vm-agent: ignition: wrote /etc/hello"} {
			if !strings.Contains(con.Console, want) {
				t.Errorf("console lacks %q:\n%s", want, con.Console)
			}
		}
		var met struct {
			Host struct {
				State              string
				Pid                *int
				CPUSeconds         *float64 `json:"cpu_seconds"`
				MemoryRSSBytes     *int64   `json:"memory_rss_bytes"`
				BootToReadySeconds *float64 `json:"boot_to_ready_seconds"`
				Attestation        string
				BootPhases         map[string]float64 `json:"boot_phases"`
			}
		}
		var att struct {
			Required         *bool
			UserDataReleased bool
			Boot             int
		}
		getJSON(t, a.base+"/vms/"+t1.ID+"/attestation", &att)
		if att.Required == nil || *att.Required || !att.UserDataReleased || att.Boot != 1 {
			t.Errorf("attestation service's view of the boot: %+v", att)
		}
		if r := a.exec(t1.ID, "cat", "/etc/hello"); r.Stdout != "hi" || r.ExitCode != 0 {
			t.Errorf("exec cat /etc/hello: %+v", r)
		}
		getJSON(t, a.base+"/vms/"+t1.ID+"/metrics", &met)
		h := met.Host
		if h.State != "ready" || h.Pid == nil || *h.Pid != t1.Processes.Qemu.Pid || h.MemoryRSSBytes == nil || *h.MemoryRSSBytes <= 0 || h.BootToReadySeconds == nil || h.Attestation != "disabled" {
			t.Errorf("metrics %+v", h)
		}
		// The launch's phases: the host's and, read from the console at
		// READY=1, the guest's; together no longer than the launch.
		var sum float64
		for _, k := range []string{"provision", "register", "swtpm", "qemu", "firmware", "kernel", "agent"} {
			v, ok := h.BootPhases[k+"_seconds"]
			if !ok || v < 0 {
				t.Errorf("boot_phases.%s_seconds = %v (present %v) in %v", k, v, ok, h.BootPhases)
			}
			sum += v
		}
		if total := h.BootPhases["total_seconds"]; h.BootPhases["firmware_seconds"] <= 0 || h.BootPhases["kernel_seconds"] <= 0 || sum > total+0.05 {
			t.Errorf("boot_phases %v: a firmware and a kernel phase, and phases summing (%.3f) to at most total_seconds", h.BootPhases, sum)
		}
	})
	if t1.ID == "" {
		t.FailNow()
	}
	a.t = t

	t.Run("networks", func(t *testing.T) {
		a.t = t
		if t1.Network != "default" || !strings.HasPrefix(t1.IP, "192.168.127.") || t1.Zone != "default" || !strings.HasPrefix(t1.MAC, "02:") || !strings.HasSuffix(t1.MAC, ":c0:a8:7f:02") {
			t.Errorf("t1 on the network: %+v", t1)
		}
		var def struct {
			Leases []struct{ VMID, IP, MAC string } `json:"leases"`
		}
		getJSON(t, a.base+"/networks/default", &def)
		if len(def.Leases) != 1 || def.Leases[0].IP != t1.IP || def.Leases[0].MAC != t1.MAC {
			t.Errorf("default network leases %+v", def.Leases)
		}
		expectError(t, "DELETE", a.base+"/networks/default", "", 409, apierr.Conflict)
		code, _, b := cluster.Do(t, "POST", a.base+"/networks", `{"name":"n1","cidr":"10.10.0.0/29","dns_search_domain":"lab.local"}`)
		if code != 201 || !strings.Contains(string(b), `"gateway": "10.10.0.1"`) {
			t.Fatalf("create network: %d %s", code, b)
		}
		expectError(t, "POST", a.base+"/networks", `{"name":"n1","cidr":"10.20.0.0/24"}`, 409, apierr.Conflict)
		expectError(t, "POST", a.base+"/networks", `{"name":"n2","cidr":"10.20.0.0/30"}`, 400, apierr.InvalidRequest)
		expectError(t, "POST", a.base+"/networks", `{"name":"n2","cidr":"169.254.0.0/24"}`, 400, apierr.InvalidRequest)
		expectError(t, "POST", a.base+"/networks", `{"name":"N2","cidr":"10.20.0.0/24"}`, 400, apierr.InvalidRequest)
		expectError(t, "POST", a.base+"/vms", `{"name":"x","network":"nope","require_attestation":false}`, 400, apierr.InvalidRequest)
		if code, _, b := cluster.Do(t, "DELETE", a.base+"/networks/n1", ""); code != 204 {
			t.Errorf("delete network: %d %s", code, b)
		}
		expectError(t, "GET", a.base+"/networks/n1", "", 404, apierr.NotFound)
	})

	t.Run("validation and conflicts", func(t *testing.T) {
		a.t = t
		expectError(t, "POST", a.base+"/vms", `{"name":"t1","require_attestation":false}`, 409, apierr.Conflict)
		expectError(t, "POST", a.base+"/vms", `{"name":"Bad_Name","require_attestation":false}`, 400, apierr.InvalidRequest)
		expectError(t, "POST", a.base+"/vms", `{"name":"x","cpus":-1,"require_attestation":false}`, 400, apierr.InvalidRequest)
		expectError(t, "POST", a.base+"/vms", `{"name":"x","memory_mib":128,"require_attestation":false}`, 400, apierr.InvalidRequest)
		expectError(t, "POST", a.base+"/vms", `{"name":"x","image":"nope","require_attestation":false}`, 400, apierr.InvalidRequest)
		expectError(t, "POST", a.base+"/vms/"+t1.ID+"/start", "", 409, apierr.Conflict)
		expectError(t, "GET", a.base+"/vms/"+t1.ID+"/console?lines=abc", "", 400, apierr.InvalidRequest)
		var list []vmJSON
		getJSON(t, a.base+"/vms", &list)
		if len(list) != 1 || list[0].ID != t1.ID {
			t.Errorf("a rejected create left a record: %+v", list)
		}
	})

	t.Run("stop start reboot", func(t *testing.T) {
		a.t = t
		pid := t1.Processes.Qemu.Pid
		v := a.vm("POST", "/vms/"+t1.ID+"/stop", "", 200)
		if v.State != "stopped" || v.Processes != nil {
			t.Fatalf("after stop: %+v", v)
		}
		waitGone(t, pid, "qemu")
		expectError(t, "POST", a.base+"/vms/"+t1.ID+"/stop", "", 409, apierr.Conflict)
		v = a.vm("POST", "/vms/"+t1.ID+"/start", "", 200)
		if v.State != "booting" {
			t.Errorf("start returned %s", v.State)
		}
		v = a.waitState(t1.ID, "ready", bootTimeout)
		pid = v.Processes.Qemu.Pid
		v = a.vm("POST", "/vms/"+t1.ID+"/reboot", "", 200)
		if v.State != "booting" || v.Processes == nil || v.Processes.Qemu.Pid == pid {
			t.Errorf("reboot returned %+v", v)
		}
		a.waitState(t1.ID, "ready", bootTimeout)
	})

	t.Run("delete", func(t *testing.T) {
		a.t = t
		v := a.get(t1.ID)
		a.vm("DELETE", "/vms/"+t1.ID, "", 204)
		waitGone(t, v.Processes.Qemu.Pid, "qemu")
		waitGone(t, v.Processes.Tpm.Pid, "swtpm")
		if _, err := os.Stat(v.Paths.Dir); !os.IsNotExist(err) {
			t.Errorf("vm directory %s still exists: %v", v.Paths.Dir, err)
		}
		expectError(t, "GET", a.base+"/vms/"+t1.ID, "", 404, apierr.NotFound)
		expectError(t, "GET", a.base+"/vms/"+t1.ID+"/attestation", "", 404, apierr.NotFound)
	})

	var pair []vmJSON
	t.Run("three concurrent creates", func(t *testing.T) {
		a.t = t
		var wg sync.WaitGroup
		out := make([]vmJSON, 3)
		for i := range out {
			wg.Go(func() {
				out[i] = a.vm("POST", "/vms", fmt.Sprintf(`{"name":"c%d","image":"test-guest","require_attestation":false,"memory_mib":384,"cpus":1}`, i), 201)
			})
		}
		wg.Wait()
		for _, v := range out {
			if v.State != "ready" {
				t.Errorf("%s: %s %s", v.Name, v.State, v.LastError)
			}
		}
		pair = out[:2]
		a.vm("DELETE", "/vms/"+out[2].ID, "", 204)
	})

	t.Run("hypervisor SIGKILL and re-adoption", func(t *testing.T) {
		a.t = t
		if len(pair) != 2 {
			t.Skip("needs the VMs of the concurrent test")
		}
		fwd := a.forward(pair[0].ID, 22)
		c.StopService("hypervisor") // SIGKILL for a process; in-process, a stop that detaches
		for _, v := range pair {
			if !alive(v.Processes.Qemu.Pid) {
				t.Fatalf("qemu of %s died with the hypervisor", v.Name)
			}
		}
		c.StartService("hypervisor")
		c.WaitReady(20 * time.Second)
		for _, v := range pair {
			now := a.get(v.ID)
			if now.State != "ready" || now.Processes == nil || now.Processes.Qemu.Pid != v.Processes.Qemu.Pid {
				t.Errorf("%s after restart: %+v (was qemu pid %d)", v.Name, now, v.Processes.Qemu.Pid)
			}
		}
		// The NIC is dialled again and the forward bound again.
		if r := a.exec(pair[0].ID, "hostname"); r.Stdout != "c0\n" {
			t.Errorf("exec after re-adoption: %+v", r)
		}
		if line, err := sshBanner(fwd); err != nil || !strings.HasPrefix(line, "SSH-2.0-") {
			t.Errorf("forward after re-adoption answered %q, %v", line, err)
		}
		stopped := a.vm("POST", "/vms/"+pair[0].ID+"/stop", "", 200)
		if stopped.State != "stopped" {
			t.Errorf("stop after re-adoption: %+v", stopped)
		}
		a.vm("DELETE", "/vms/"+pair[0].ID, "", 204)
		a.vm("DELETE", "/vms/"+pair[1].ID, "", 204)
		waitGone(t, pair[1].Processes.Qemu.Pid, "qemu")
	})

	t.Run("attestation gates user-data", func(t *testing.T) {
		a.t = t
		ignition := `{\"ignition\":{\"version\":\"3.4.0\"},\"storage\":{\"files\":[{\"path\":\"/etc/secret\",\"contents\":{\"source\":\"data:,s3cret\"}}]}}`
		// require_attestation defaults to true; the image has no policy yet.
		v := a.vm("POST", "/vms", `{"name":"gated","image":"test-guest","memory_mib":512,"cpus":1,"user_data":"`+ignition+`"}`, 201)
		var att struct {
			Required, UserDataReleased bool
			Initrd                     struct {
				Verified bool
				Message  string
				Pcrs     map[string]string
			}
		}
		getJSON(t, a.base+"/vms/"+v.ID+"/attestation", &att)
		if !att.Required || att.UserDataReleased || att.Initrd.Verified || !strings.HasPrefix(att.Initrd.Message, "no policy for image test-guest_0.1.0") {
			t.Fatalf("without a policy: %+v", att)
		}
		if v = a.get(v.ID); !strings.HasPrefix(v.LastError, "initrd attestation rejected: no policy") {
			t.Errorf("lastError %q", v.LastError)
		}
		var con struct{ Console string }
		getJSON(t, a.base+"/vms/"+v.ID+"/console?lines=500", &con)
		if !strings.Contains(con.Console, "Attestation rejected: no policy") || strings.Contains(con.Console, "/etc/secret") {
			t.Errorf("console of the rejected boot:\n%s", con.Console)
		}
		// The operator takes this boot's PCRs as golden values: the firmware's,
		// and PCR 9, which pins the initrd and command line of a direct-kernel boot.
		golden := map[string]string{}
		for _, i := range []string{"0", "2", "3", "4", "6", "7", "9"} {
			golden[i] = att.Initrd.Pcrs[i]
		}
		policy, _ := json.Marshal(map[string]any{"image_id": "test-guest", "image_version": "0.1.0", "golden": map[string]any{"sha256": golden}})
		if code, _, b := cluster.Do(t, "PUT", a.base+"/images/test-guest_0.1.0/policy", string(policy)); code != 200 {
			t.Fatalf("import policy: %d %s", code, b)
		}
		a.vm("POST", "/vms/"+v.ID+"/reboot", "", 200)
		v = a.waitState(v.ID, "ready", bootTimeout)
		getJSON(t, a.base+"/vms/"+v.ID+"/attestation", &att)
		if !att.UserDataReleased || !att.Initrd.Verified || v.LastError != "" {
			t.Fatalf("after the policy: %+v, lastError %q", att, v.LastError)
		}
		getJSON(t, a.base+"/vms/"+v.ID+"/console?lines=60", &con)
		if !strings.Contains(con.Console, "attestation verified: verified: ak ") || !strings.Contains(con.Console, "ignition: wrote /etc/secret") {
			t.Errorf("console of the verified boot:\n%s", con.Console)
		}
		a.vm("DELETE", "/vms/"+v.ID, "", 204)
		if code, _, b := cluster.Do(t, "DELETE", a.base+"/images/test-guest_0.1.0/policy/golden", ""); code != 200 {
			t.Errorf("clear golden: %d %s", code, b)
		}
	})

	t.Run("guest powers itself off", func(t *testing.T) {
		a.t = t
		v := a.vm("POST", "/vms", `{"name":"oneshot","image":"oneshot-guest","require_attestation":false,"memory_mib":384,"cpus":1}`, 201)
		v = a.waitState(v.ID, "stopped", bootTimeout)
		if v.LastError != "guest shut down" || v.Processes != nil || !v.Booted {
			t.Errorf("after the guest's power-off: %+v", v)
		}
		a.vm("DELETE", "/vms/"+v.ID, "", 204)
	})

	t.Run("qemu dies", func(t *testing.T) {
		a.t = t
		v := a.vm("POST", "/vms", `{"name":"victim","image":"test-guest","require_attestation":false,"memory_mib":384,"cpus":1}`, 201)
		if err := syscall.Kill(v.Processes.Qemu.Pid, syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		v = a.waitState(v.ID, "failed", 30*time.Second)
		if !strings.HasPrefix(v.LastError, "qemu exited: ") || !strings.Contains(v.LastError, "\nconsole:\n") || !strings.Contains(v.LastError, "vm-agent: ") {
			t.Errorf("lastError %q", v.LastError)
		}
		if v.Processes != nil {
			t.Errorf("a failed vm still lists processes: %+v", v.Processes)
		}
		a.vm("DELETE", "/vms/"+v.ID, "", 204)
	})
}

// killVMs deletes whatever a failed test left behind, so no QEMU outlives it.
func killVMs(t *testing.T, c *cluster.Cluster, a api) { killVMsAt(t, a.base) }

// killVMsAt ends the QEMU and swtpm of every VM the API at base lists (the
// hypervisor leaves them running when it exits).
func killVMsAt(t testing.TB, base string) {
	code, _, b := cluster.Do(t, "GET", base+"/vms", "")
	var list []vmJSON
	if code == http.StatusOK && json.Unmarshal(b, &list) == nil {
		for _, v := range list {
			if v.Processes != nil {
				cluster.KillLeftovers(t, v.Processes.Qemu.Pid, v.Processes.Tpm.Pid)
			}
		}
	}
}
