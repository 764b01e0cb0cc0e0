package tests

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/tests/cluster"
)

// metricValue is the value of one series of /metrics ("" labels: a family
// without labels); -1 when it is absent.
func metricValue(t *testing.T, addr, name, labels string) float64 {
	t.Helper()
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name+labels) + ` (\S+)$`)
	m := re.FindStringSubmatch(scrapeMetrics(t, addr))
	if m == nil {
		return -1
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		t.Fatalf("%s%s: %v", name, labels, err)
	}
	return v
}

// TestBoundsREST is issue 16's per-host and per-VM bounds through REST and
// MCP on the three binaries: ssh_authorized_keys, memory and CPUs over the
// host's bounds are invalid_request naming the field; VMs, networks and
// forwards over theirs are resource_exhausted; nothing is created, the
// refusals are counted in /metrics, and a restart with a lower --max-vms
// keeps every VM.
func TestBoundsREST(t *testing.T) {
	images := cluster.GuestImages(t, "..")
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, Env: []string{
		"VM_MANAGER_MAX_VMS=2", "VM_MANAGER_MAX_NETWORKS=2", "VM_MANAGER_MAX_FORWARDS_PER_VM=1",
		"VM_MANAGER_MAX_MEMORY_MIB=1024", "VM_MANAGER_MAX_CPUS=2",
		"VM_MANAGER_STOP_TIMEOUT=3s", // the VMs are deleted while they boot
	}})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })
	vmDirs := func() int {
		d, _ := os.ReadDir(filepath.Join(c.StateDir, "vms"))
		return len(d)
	}
	listed := func(path string) int {
		var l []json.RawMessage
		getJSON(t, a.base+path, &l)
		return len(l)
	}
	keys := func(n, size int) string {
		k := make([]string, n)
		for i := range k {
			k[i] = "ssh-ed25519 " + strings.Repeat("A", size-len("ssh-ed25519 "))
		}
		b, _ := json.Marshal(k)
		return string(b)
	}

	t.Run("request bounds", func(t *testing.T) {
		for _, tc := range []struct{ body, want string }{
			{`{"name":"k","memory_mib":256,"cpus":1,"ssh_authorized_keys":` + keys(33, 100) + `}`, "at most 32 ssh_authorized_keys, got 33"},
			{`{"name":"k","memory_mib":256,"cpus":1,"ssh_authorized_keys":` + keys(1, 8193) + `}`, "ssh_authorized_keys[0] is 8193 bytes, at most 8192"},
			{`{"name":"m","memory_mib":1025}`, "memory_mib 1025 is above this host's maximum of 1024 (--max-memory-mib)"},
			{`{"name":"m","memory_mib":256,"cpus":3}`, "cpus 3 is above this host's maximum of 2 (--max-cpus)"},
		} {
			msg := expectError(t, "POST", a.base+"/vms", tc.body, 400, apierr.InvalidRequest)
			if msg != tc.want {
				t.Errorf("message %q, want %q", msg, tc.want)
			}
		}
		if n, d := listed("/vms"), vmDirs(); n != 0 || d != 0 {
			t.Fatalf("refused creates left %d VMs and %d directories", n, d)
		}
	})

	var vms []vmJSON
	t.Run("max VMs", func(t *testing.T) {
		for _, name := range []string{"b1", "b2"} {
			vms = append(vms, a.vm("POST", "/vms", `{"name":"`+name+`","image":"test-guest","require_attestation":false,"memory_mib":256,"cpus":1,"wait_for":"none","ssh_authorized_keys":`+keys(32, 8192)+`}`, 201))
		}
		msg := expectError(t, "POST", a.base+"/vms", `{"name":"b3","image":"test-guest","memory_mib":256,"cpus":1,"wait_for":"none"}`, 429, apierr.ResourceExhausted)
		if msg != "this host has 2 VMs, the maximum is 2 (--max-vms): delete one first" {
			t.Errorf("message %q", msg)
		}
		// MCP says the same code.
		cs := mcpSession(t, c.Addr, "", nil)
		if text := callTool(t, cs, "create_vm", map[string]any{"name": "b3", "image": "test-guest", "memory_mib": 256, "cpus": 1, "wait_for": "none"}, true); !strings.HasPrefix(text, "resource_exhausted: this host has 2 VMs") {
			t.Errorf("MCP: %q", text)
		}
		if n, d := listed("/vms"), vmDirs(); n != 2 || d != 2 {
			t.Errorf("after the refusals: %d VMs, %d directories", n, d)
		}
		if v := metricValue(t, c.Addr, "vm_manager_limit_refusals_total", `{limit="vms"}`); v != 2 {
			t.Errorf(`vm_manager_limit_refusals_total{limit="vms"} = %v, want 2`, v)
		}
	})
	if len(vms) != 2 {
		t.FailNow()
	}

	t.Run("max networks", func(t *testing.T) {
		a.vm("POST", "/networks", `{"name":"second","cidr":"10.77.0.0/24"}`, 201)
		msg := expectError(t, "POST", a.base+"/networks", `{"name":"third","cidr":"10.78.0.0/24"}`, 429, apierr.ResourceExhausted)
		if msg != "this host has 2 networks, the maximum is 2 (--max-networks): delete one first" {
			t.Errorf("message %q", msg)
		}
		expectError(t, "GET", a.base+"/networks/third", "", 404, apierr.NotFound)
		if n := listed("/networks"); n != 2 {
			t.Errorf("%d networks", n)
		}
		if v := metricValue(t, c.Addr, "vm_manager_limit_refusals_total", `{limit="networks"}`); v != 1 {
			t.Errorf(`refusals{limit="networks"} = %v`, v)
		}
	})

	t.Run("max forwards per VM", func(t *testing.T) {
		first := a.forward(vms[0].ID, 22)
		if again := a.forward(vms[0].ID, 22); again != first {
			t.Errorf("asking again for a forwarded port: %s, then %s", first, again)
		}
		msg := expectError(t, "POST", a.base+"/vms/"+vms[0].ID+"/forward", `{"port":80}`, 429, apierr.ResourceExhausted)
		if want := fmt.Sprintf("vm %s has 1 port forwards, the maximum is 1 (--max-forwards-per-vm)", vms[0].ID); msg != want {
			t.Errorf("message %q, want %q", msg, want)
		}
		a.forward(vms[1].ID, 22) // per VM, not per host
		if fw := a.get(vms[0].ID); fw.ID == "" {
			t.Fatal("vm gone")
		}
	})

	t.Run("a lower bound keeps what exists", func(t *testing.T) {
		c.StopService("hypervisor")
		c.SetEnv("VM_MANAGER_MAX_VMS=1", "VM_MANAGER_MAX_NETWORKS=1", "VM_MANAGER_STOP_TIMEOUT=3s")
		c.StartService("hypervisor")
		c.WaitReady(30 * time.Second)
		if n, nets := listed("/vms"), listed("/networks"); n != 2 || nets != 2 {
			t.Fatalf("after a restart with --max-vms=1 --max-networks=1: %d VMs, %d networks", n, nets)
		}
		expectError(t, "POST", a.base+"/vms", `{"name":"b3","image":"test-guest","memory_mib":256,"cpus":1,"wait_for":"none"}`, 429, apierr.ResourceExhausted)
		a.vm("DELETE", "/vms/"+vms[0].ID, "", 204)
		expectError(t, "POST", a.base+"/vms", `{"name":"b3","image":"test-guest","memory_mib":256,"cpus":1,"wait_for":"none"}`, 429, apierr.ResourceExhausted)
		a.vm("DELETE", "/vms/"+vms[1].ID, "", 204)
		v := a.vm("POST", "/vms", `{"name":"b3","image":"test-guest","require_attestation":false,"memory_mib":256,"cpus":1,"wait_for":"none"}`, 201)
		a.vm("DELETE", "/vms/"+v.ID, "", 204)
	})
}
