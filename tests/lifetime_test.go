package tests

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/tests/cluster"
)

// lifetimeJSON is a REST VM record's lifetime.
type lifetimeJSON struct {
	ExpireAt       time.Time `json:"expireAt"`
	OnExpire       string    `json:"onExpire"`
	IdleTimeout    string    `json:"idleTimeout"`
	OnIdle         string    `json:"onIdle"`
	LastActivityAt time.Time `json:"lastActivityAt"`
	LastActivity   string    `json:"lastActivity"`
}

type lifetimeVM struct {
	vmJSON
	Lifetime *lifetimeJSON `json:"lifetime"`
}

func (a api) lifetimeVM(method, path, body string, wantStatus int) lifetimeVM {
	a.t.Helper()
	code, _, b := cluster.Do(a.t, method, a.base+path, body)
	if code != wantStatus {
		a.t.Fatalf("%s %s: %d, want %d: %s", method, path, code, wantStatus, b)
	}
	var v lifetimeVM
	if err := json.Unmarshal(b, &v); err != nil {
		a.t.Fatalf("%s %s: %v", method, path, err)
	}
	return v
}

// waitStopped waits for a VM to be stopped and returns it with the time it
// was first seen so.
func (a api) waitStopped(id string, d time.Duration) (lifetimeVM, time.Time) {
	a.t.Helper()
	var v lifetimeVM
	cluster.Eventually(a.t, d, "vm "+id+" stopped", func() error {
		v = a.lifetimeVM("GET", "/vms/"+id, "", 200)
		if v.State != "stopped" {
			return fmt.Errorf("state %s (lastError %q)", v.State, v.LastError)
		}
		return nil
	})
	return v, time.Now()
}

// TestVMLifetimes boots the real test guest through the three binaries: a
// ttl that stops a VM (extended once), one that deletes it, an idle
// timeout that exec keeps at bay and then stops it, and an expiry that
// passes while the hypervisor is SIGKILLed, carried out at its restart.
func TestVMLifetimes(t *testing.T) {
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: cluster.GuestImages(t, "..")})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })
	const vmSpec = `"image":"test-guest","require_attestation":false,"memory_mib":384,"cpus":1`

	expectError(t, "POST", a.base+"/vms", `{"name":"bad","ttl":"60"}`, 400, apierr.InvalidRequest)
	expectError(t, "POST", a.base+"/vms", `{"name":"bad","ttl":"1h","expire_at":"2030-01-01T00:00:00Z"}`, 400, apierr.InvalidRequest)
	expectError(t, "POST", a.base+"/vms", `{"name":"bad","on_expire":"delete"}`, 400, apierr.InvalidRequest)
	expectError(t, "POST", a.base+"/vms", `{"name":"bad","idle_timeout":"1s"}`, 400, apierr.InvalidRequest)
	if code, _, b := cluster.Do(t, "GET", a.base+"/vms", ""); code != 200 || strings.Join(strings.Fields(string(b)), "") != "[]" {
		t.Fatalf("refused creates left VMs: %d %s", code, b)
	}

	t.Run("group", func(t *testing.T) {
		t.Run("ttl stops, extended", func(t *testing.T) {
			t.Parallel()
			a := api{t: t, base: a.base}
			// A long ttl at create (a loaded host boots slowly), shortened
			// once the guest is ready, then extended.
			v := a.lifetimeVM("POST", "/vms", `{"name":"ttl-stop",`+vmSpec+`,"ttl":"10m"}`, 201)
			if v.Lifetime == nil || v.Lifetime.OnExpire != "stop" {
				t.Fatalf("lifetime %+v", v.Lifetime)
			}
			first := a.lifetimeVM("POST", "/vms/"+v.ID+"/lifetime", `{"ttl":"20s"}`, 200).Lifetime
			v = a.lifetimeVM("POST", "/vms/"+v.ID+"/lifetime", `{"ttl":"60s"}`, 200)
			if !v.Lifetime.ExpireAt.After(first.ExpireAt) {
				t.Fatalf("extend: expireAt %s, was %s", v.Lifetime.ExpireAt, first.ExpireAt)
			}
			_, _, m := cluster.Do(t, "GET", "http://"+c.Addr+"/metrics", "")
			if want := `vm_manager_vm_expire_timestamp_seconds{name="ttl-stop",on_expire="stop",vm="` + v.ID + `"}`; !strings.Contains(string(m), want) {
				t.Errorf("/metrics has no %s", want)
			}
			stopped, seen := a.waitStopped(v.ID, 4*time.Minute)
			if seen.Before(v.Lifetime.ExpireAt) {
				t.Errorf("stopped before its extended expiry %s", v.Lifetime.ExpireAt)
			}
			if !strings.Contains(stopped.LastError, "lifetime expired") || stopped.Lifetime != nil || stopped.Processes != nil {
				t.Errorf("stopped record: lastError %q, lifetime %+v", stopped.LastError, stopped.Lifetime)
			}
			t.Logf("ttl 60s: stop seen %.1fs after expireAt", seen.Sub(v.Lifetime.ExpireAt).Seconds())
			a.vm("DELETE", "/vms/"+v.ID, "", 204)
		})
		t.Run("ttl deletes", func(t *testing.T) {
			t.Parallel()
			a := api{t: t, base: a.base}
			v := a.lifetimeVM("POST", "/vms", `{"name":"ttl-delete",`+vmSpec+`,"ttl":"10m","on_expire":"delete"}`, 201)
			v = a.lifetimeVM("POST", "/vms/"+v.ID+"/lifetime", `{"ttl":"30s"}`, 200)
			if v.Lifetime == nil || v.Lifetime.OnExpire != "delete" {
				t.Fatalf("lifetime %+v", v.Lifetime)
			}
			qemu := v.Processes.Qemu.Pid
			cluster.Eventually(t, 4*time.Minute, "vm deleted", func() error {
				if code, _, b := cluster.Do(t, "GET", a.base+"/vms/"+v.ID, ""); code != http.StatusNotFound {
					return fmt.Errorf("%d %.200s", code, b)
				}
				return nil
			})
			waitGone(t, qemu, "qemu of the expired vm")
		})
		t.Run("idle stops, exec resets", func(t *testing.T) {
			t.Parallel()
			a := api{t: t, base: a.base}
			v := a.lifetimeVM("POST", "/vms", `{"name":"idle",`+vmSpec+`,"idle_timeout":"20s"}`, 201)
			if v.Lifetime == nil || v.Lifetime.IdleTimeout != "20s" || v.Lifetime.OnIdle != "stop" {
				t.Fatalf("lifetime %+v", v.Lifetime)
			}
			// Exec every 5 s for longer than the timeout: the VM stays up.
			for end := time.Now().Add(35 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Second) {
				if code, _, b := cluster.Do(t, "POST", a.base+"/vms/"+v.ID+"/exec", `{"command":["true"]}`); code != 200 {
					t.Fatalf("exec: %d %s", code, b)
				}
			}
			v = a.lifetimeVM("GET", "/vms/"+v.ID, "", 200)
			if v.State != "ready" || v.Lifetime.LastActivity != "exec" {
				t.Fatalf("after execs: state %s, lifetime %+v", v.State, v.Lifetime)
			}
			// Then quiet (the guest's own report uploads do not count).
			stopped, _ := a.waitStopped(v.ID, 3*time.Minute)
			if !strings.Contains(stopped.LastError, "idle_timeout") || stopped.Lifetime == nil || stopped.Lifetime.IdleTimeout != "20s" {
				t.Errorf("stopped record: lastError %q, lifetime %+v", stopped.LastError, stopped.Lifetime)
			}
			a.vm("DELETE", "/vms/"+v.ID, "", 204)
		})
	})

	t.Run("expiry across a hypervisor SIGKILL", func(t *testing.T) {
		a := api{t: t, base: a.base}
		v := a.lifetimeVM("POST", "/vms", `{"name":"restart",`+vmSpec+`,"ttl":"10m"}`, 201)
		v = a.lifetimeVM("POST", "/vms/"+v.ID+"/lifetime", `{"ttl":"15s"}`, 200)
		c.StopService("hypervisor") // SIGKILL: the VM keeps running, nothing watches its expiry
		if !alive(v.Processes.Qemu.Pid) {
			t.Fatal("qemu died with the hypervisor")
		}
		time.Sleep(time.Until(v.Lifetime.ExpireAt) + 2*time.Second)
		c.StartService("hypervisor")
		stopped, _ := a.waitStopped(v.ID, 2*time.Minute)
		if !strings.Contains(stopped.LastError, "lifetime expired") {
			t.Errorf("lastError %q", stopped.LastError)
		}
		waitGone(t, v.Processes.Qemu.Pid, "qemu of the expired vm")
		_, _, m := cluster.Do(t, "GET", "http://"+c.Addr+"/metrics", "")
		if want := `vm_manager_vm_lifetime_actions_total{action="stop",reason="expired"} 1`; !strings.Contains(string(m), want) {
			t.Errorf("/metrics has no %s", want)
		}
		a.vm("DELETE", "/vms/"+v.ID, "", 204)
	})
}
