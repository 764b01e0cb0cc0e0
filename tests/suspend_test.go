package tests

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/tests/cluster"
)

// TestSuspendResume suspends real guests to disk and resumes them (issue
// 19): the same boot carries on (a file in the guest's RAM, the attestation
// verdicts and the vTPM's AK), exec, a forward and the IMDS work again, the
// guest's clock is stepped; a corrupted state and a state copied into
// another VM are refused and the VM stays suspended; a suspended VM survives
// a hypervisor SIGKILL; stop discards a saved state; delete removes it.
func TestSuspendResume(t *testing.T) {
	images := cluster.GuestImages(t, "..")
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, LearnGolden: true})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })

	s1 := a.vm("POST", "/vms", `{"name":"s1","image":"test-guest","memory_mib":512,"cpus":1,"user_data":`+ignitionFile("/etc/s1", "one")+`}`, 201)
	if s1.State != "ready" {
		t.Fatalf("s1: %+v", s1)
	}
	before := a.record(s1.ID)
	if before.Tpm == nil || before.Attestation.AkFingerprint != before.Tpm.AkFingerprint || !before.Attestation.UserDataReleased {
		t.Fatalf("s1 record: %+v", before)
	}
	fwd := a.forward(s1.ID, 22)
	if r := a.sh(s1.ID, "echo alive > /tmp/marker"); r.ExitCode != 0 {
		t.Fatalf("marker: %+v", r)
	}
	saved := filepath.Join(s1.Paths.Dir, "suspend")

	suspend := func(id string) vmJSON {
		t.Helper()
		pids := a.get(id).Processes
		v := a.vm("POST", "/vms/"+id+"/suspend", "", 200)
		if v.State != "suspended" || v.Processes != nil {
			t.Fatalf("after suspend: %+v", v)
		}
		if pids != nil {
			waitGone(t, pids.Qemu.Pid, "qemu")
			waitGone(t, pids.Tpm.Pid, "swtpm")
		}
		return v
	}

	t.Run("suspend and resume", func(t *testing.T) {
		a.t = t
		suspend(s1.ID)
		for _, f := range []string{"state.bin", "manifest.json"} {
			if _, err := os.Stat(filepath.Join(saved, f)); err != nil {
				t.Errorf("saved state: %v", err)
			}
		}
		// Suspending again is a no-op; start and exec say what to do.
		a.vm("POST", "/vms/"+s1.ID+"/suspend", "", 200)
		if b := expectError(t, "POST", a.base+"/vms/"+s1.ID+"/start", "", 409, apierr.Conflict); !strings.Contains(b, "resume") {
			t.Errorf("start of a suspended vm: %s", b)
		}
		expectError(t, "POST", a.base+"/vms/"+s1.ID+"/exec", `{"command":["true"]}`, 409, apierr.Conflict)
		// Let the guest's clock fall behind, so that the step after the resume shows.
		time.Sleep(8 * time.Second)

		v := a.vm("POST", "/vms/"+s1.ID+"/resume", "", 200)
		if v.State != "ready" || v.Processes == nil || v.LastError != "" {
			t.Fatalf("after resume: %+v", v)
		}
		if _, err := os.Stat(saved); !os.IsNotExist(err) {
			t.Errorf("the saved state outlived the resume: %v", err)
		}
		// The same boot: RAM, user data, verdicts, boot count and AK carried over.
		if r := a.exec(s1.ID, "cat", "/tmp/marker", "/etc/s1"); r.Stdout != "alive\none" {
			t.Errorf("after resume: %+v", r)
		}
		after := a.record(s1.ID)
		if after.BootCount != before.BootCount || after.Attestation.AkFingerprint != before.Attestation.AkFingerprint ||
			after.Tpm.AkFingerprint != before.Tpm.AkFingerprint || !after.Attestation.UserDataReleased {
			t.Errorf("record after resume %+v, before %+v", after, before)
		}
		// A fresh quote from the resumed vTPM verifies against the AK the host registered.
		if r := a.exec(s1.ID, "/init", "attest", "--stage=ready"); r.ExitCode != 0 {
			t.Errorf("quote after resume: exit %d %s%s", r.ExitCode, r.Stdout, r.Stderr)
		}
		if r := a.record(s1.ID); r.Attestation.AkFingerprint != before.Tpm.AkFingerprint {
			t.Errorf("attestation after the quote: %+v", r.Attestation)
		}
		// The network: the IMDS, and the forward bound before the suspend.
		if r := a.sh(s1.ID, imdsFunc+"imds user-data -v"); r.ExitCode != 0 || !strings.Contains(r.Stdout, " 200 ") {
			t.Errorf("IMDS after resume: %+v", r)
		}
		if line, err := sshBanner(fwd); err != nil || !strings.HasPrefix(line, "SSH-2.0-") {
			t.Errorf("forward after resume answered %q, %v", line, err)
		}
		// The clock, stepped by the hypervisor after the resume.
		cluster.Eventually(t, 30*time.Second, "guest clock", func() error {
			r := a.exec(s1.ID, "date", "-u", "+%s")
			g, err := strconv.ParseInt(strings.TrimSpace(r.Stdout), 10, 64)
			if err != nil {
				return fmt.Errorf("date: %+v", r)
			}
			if d := time.Now().Unix() - g; d > 3 || d < -3 {
				return fmt.Errorf("guest clock %ds off the host's", d)
			}
			return nil
		})
	})

	t.Run("a corrupted state is refused and kept", func(t *testing.T) {
		a.t = t
		suspend(s1.ID)
		state := filepath.Join(saved, "state.bin")
		flip := func() {
			f, err := os.OpenFile(state, os.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			fi, _ := f.Stat()
			b := make([]byte, 1)
			at := fi.Size() / 2 // in the RAM: QEMU itself would load it
			if _, err := f.ReadAt(b, at); err != nil {
				t.Fatal(err)
			}
			b[0] ^= 0xff
			if _, err := f.WriteAt(b, at); err != nil {
				t.Fatal(err)
			}
		}
		flip()
		b := expectError(t, "POST", a.base+"/vms/"+s1.ID+"/resume", "", 500, apierr.VMFailed)
		v := a.get(s1.ID)
		if v.State != "suspended" || v.Processes != nil || !strings.Contains(v.LastError, "corrupt") {
			t.Errorf("after a failed resume (%s): %+v", b, v)
		}
		// Counted: the failed resume, and the suspended VM by state.
		if v := metricValue(t, c.Addr, "vm_manager_resumes_total", `{result="failed"}`); v != 1 {
			t.Errorf("vm_manager_resumes_total{result=failed} = %v", v)
		}
		if v := metricValue(t, c.Addr, "vm_manager_suspends_total", `{result="ok"}`); v != 2 {
			t.Errorf("vm_manager_suspends_total{result=ok} = %v", v)
		}
		if v := metricValue(t, c.Addr, "vm_manager_vms", `{state="suspended"}`); v != 1 {
			t.Errorf("vm_manager_vms{state=suspended} = %v", v)
		}
		flip() // whole again
		if v := a.vm("POST", "/vms/"+s1.ID+"/resume", "", 200); v.State != "ready" {
			t.Fatalf("resume of the repaired state: %+v", v)
		}
		if r := a.exec(s1.ID, "cat", "/tmp/marker"); r.Stdout != "alive\n" {
			t.Errorf("after resume: %+v", r)
		}
	})

	t.Run("a state copied into another vm is refused", func(t *testing.T) {
		a.t = t
		s2 := a.vm("POST", "/vms", `{"name":"s2","image":"test-guest","memory_mib":384,"cpus":1,"require_attestation":false}`, 201)
		suspend(s2.ID)
		suspend(s1.ID)
		own := filepath.Join(s2.Paths.Dir, "suspend")
		if err := os.Rename(own, own+".own"); err != nil {
			t.Fatal(err)
		}
		if err := os.CopyFS(own, os.DirFS(saved)); err != nil {
			t.Fatal(err)
		}
		b := expectError(t, "POST", a.base+"/vms/"+s2.ID+"/resume", "", 500, apierr.VMFailed)
		if !strings.Contains(b, "belongs to vm") {
			t.Errorf("resume of another vm's state: %s", b)
		}
		if v := a.get(s2.ID); v.State != "suspended" || v.Processes != nil {
			t.Errorf("s2 after the refused resume: %+v", v)
		}
		if err := os.RemoveAll(own); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(own+".own", own); err != nil {
			t.Fatal(err)
		}
		// Stop discards a saved state; delete removes the VM with it.
		if v := a.vm("POST", "/vms/"+s2.ID+"/stop", "", 200); v.State != "stopped" {
			t.Errorf("stop of a suspended vm: %+v", v)
		}
		if _, err := os.Stat(own); !os.IsNotExist(err) {
			t.Errorf("stop kept the saved state: %v", err)
		}
		if code, _, b := cluster.Do(t, "DELETE", a.base+"/vms/"+s2.ID, ""); code != 204 {
			t.Errorf("delete: %d %s", code, b)
		}
	})

	t.Run("a suspended vm survives a hypervisor SIGKILL", func(t *testing.T) {
		a.t = t
		if v := a.get(s1.ID); v.State != "suspended" {
			t.Fatalf("s1: %+v", v)
		}
		c.StopService("hypervisor")
		c.StartService("hypervisor")
		c.WaitReady(30 * time.Second)
		if v := a.get(s1.ID); v.State != "suspended" || v.Processes != nil {
			t.Fatalf("s1 after the restart: %+v", v)
		}
		if v := a.vm("POST", "/vms/"+s1.ID+"/resume", "", 200); v.State != "ready" {
			t.Fatalf("resume after the restart: %+v", v)
		}
		if r := a.exec(s1.ID, "cat", "/tmp/marker"); r.Stdout != "alive\n" {
			t.Errorf("after resume: %+v", r)
		}
		suspend(s1.ID)
		if code, _, b := cluster.Do(t, "DELETE", a.base+"/vms/"+s1.ID, ""); code != 204 {
			t.Errorf("delete: %d %s", code, b)
		}
		if _, err := os.Stat(s1.Paths.Dir); !os.IsNotExist(err) {
			t.Errorf("delete left the vm's directory: %v", err)
		}
	})
}
