package tests

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/tests/cluster"
)

type execJSON struct {
	Stdout   string `json:"stdout"`
	Stderr   string `json:"stderr"`
	ExitCode int    `json:"exitCode"`
}

// exec runs argv in the guest through REST exec_vm.
func (a api) exec(id string, argv ...string) execJSON {
	a.t.Helper()
	body, _ := json.Marshal(map[string]any{"command": argv})
	code, _, b := cluster.Do(a.t, "POST", a.base+"/vms/"+id+"/exec", string(body))
	if code != 200 {
		a.t.Fatalf("exec %q in %s: %d %s", argv, id, code, b)
	}
	var r execJSON
	if err := json.Unmarshal(b, &r); err != nil {
		a.t.Fatalf("exec %q: %v: %s", argv, err, b)
	}
	return r
}

// sh runs a shell script in the guest.
func (a api) sh(id, script string) execJSON {
	a.t.Helper()
	return a.exec(id, "/bin/sh", "-c", script)
}

func (a api) forward(id string, port int) string {
	a.t.Helper()
	code, _, b := cluster.Do(a.t, "POST", a.base+"/vms/"+id+"/forward", fmt.Sprintf(`{"port":%d}`, port))
	if code != 200 {
		a.t.Fatalf("forward %d of %s: %d %s", port, id, code, b)
	}
	var r struct {
		ID      string `json:"id"`
		Port    int    `json:"port"`
		Address string `json:"address"`
	}
	if err := json.Unmarshal(b, &r); err != nil || r.ID != id || r.Port != port || !strings.HasPrefix(r.Address, "127.0.0.1:") {
		a.t.Fatalf("forward answer %s: %v", b, err)
	}
	return r.Address
}

// sshBanner reads the first line a TCP address sends.
func sshBanner(addr string) (string, error) {
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	return bufio.NewReader(c).ReadString('\n')
}

type attJSON struct {
	Required, UserDataReleased bool
	Initrd, Ready              *struct {
		Verified bool
		Message  string
		Learned  []int
	}
}

func ignitionFile(path, content string) string {
	ign, _ := json.Marshal(map[string]any{"ignition": map[string]any{"version": "3.4.0"},
		"storage": map[string]any{"files": []any{map[string]any{"path": path, "contents": map[string]any{"source": "data:," + content}}}}})
	b, _ := json.Marshal(string(ign))
	return string(b)
}

// TestNetworkEndToEnd is issue 5's acceptance on the three real binaries:
// golden values recorded from a first VM, a second VM attested at both
// stages that gets its user-data and runs exec and a port forward, a
// guest that spoofs another VM's address and learns nothing, two networks
// with one CIDR that do not see each other, a tampered command line that
// is rejected naming PCR 9, and a hypervisor SIGKILL after which exec and
// forwards still work.
func TestNetworkEndToEnd(t *testing.T) {
	images := withPoweroffImage(t, cluster.GuestImages(t, ".."))
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, LearnGolden: true})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })

	var first, app vmJSON
	t.Run("golden values from a first VM", func(t *testing.T) {
		a.t = t
		// A policy that enforces nothing is refused; learn mode needs none
		// (the image has no policy.json) and RecordGolden creates it.
		expectError(t, "PUT", a.base+"/images/test-guest_0.1.0/policy", `{"image_id":"test-guest","image_version":"0.1.0"}`, 400, apierr.InvalidRequest)
		first = a.vm("POST", "/vms", `{"name":"first","image":"test-guest","memory_mib":384,"cpus":1}`, 201)
		var att attJSON
		getJSON(t, a.base+"/vms/"+first.ID+"/attestation", &att)
		if att.Ready == nil || !att.Ready.Verified || len(att.Ready.Learned) == 0 {
			t.Fatalf("learn-mode boot: %+v", att)
		}
		if code, _, b := cluster.Do(t, "POST", a.base+"/images/test-guest_0.1.0/policy/golden", `{"from_vm":"`+first.ID+`"}`); code != 200 || !strings.Contains(string(b), `"9"`) {
			t.Fatalf("record golden: %d %s", code, b)
		}
		// From here on PCRs without a golden value are rejected.
		c.StopService("attestation")
		c.SetLearnGolden(false)
		c.StartService("attestation")
		c.WaitReady(20 * time.Second)
	})
	if first.ID == "" {
		t.FailNow()
	}

	t.Run("attested VM gets user-data, exec and a forward", func(t *testing.T) {
		a.t = t
		app = a.vm("POST", "/vms", `{"name":"app","image":"test-guest","memory_mib":384,"cpus":1,"require_attestation":true,"user_data":`+ignitionFile("/etc/app-secret", "s3cret")+`}`, 201)
		if app.State != "ready" {
			t.Fatalf("app: %+v", app)
		}
		var att attJSON
		getJSON(t, a.base+"/vms/"+app.ID+"/attestation", &att)
		if !att.Required || !att.UserDataReleased || att.Initrd == nil || !att.Initrd.Verified || att.Ready == nil || !att.Ready.Verified || len(att.Initrd.Learned)+len(att.Ready.Learned) != 0 {
			t.Fatalf("app attestation: %+v", att)
		}
		if r := a.exec(app.ID, "cat", "/etc/app-secret"); r.Stdout != "s3cret" || r.ExitCode != 0 {
			t.Errorf("cat /etc/app-secret: %+v", r)
		}
		if r := a.sh(app.ID, "echo out; echo err >&2; exit 7"); r.Stdout != "out\n" || r.Stderr != "err\n" || r.ExitCode != 7 {
			t.Errorf("exit code and streams: %+v", r)
		}
		if r := a.exec(app.ID, "echo", "it's", "a b"); r.Stdout != "it's a b\n" {
			t.Errorf("quoting: %+v", r)
		}
		addr := a.forward(app.ID, 22)
		if again := a.forward(app.ID, 22); again != addr {
			t.Errorf("a second forward of port 22 is %s, the first %s", again, addr)
		}
		if line, err := sshBanner(addr); err != nil || !strings.HasPrefix(line, "SSH-2.0-") {
			t.Errorf("forwarded port 22 answered %q, %v", line, err)
		}
		expectError(t, "POST", a.base+"/vms/"+app.ID+"/exec", `{"command":[]}`, 400, apierr.InvalidRequest)
		expectError(t, "POST", a.base+"/vms/"+app.ID+"/forward", `{"port":0}`, 400, apierr.InvalidRequest)
		expectError(t, "POST", a.base+"/vms/ffffffff/exec", `{"command":["true"]}`, 404, apierr.NotFound)
		// The guest's report upload reaches the metrics and the report route.
		cluster.Eventually(t, 40*time.Second, "guest report", func() error {
			var met struct {
				Guest *struct{ Series int } `json:"guest"`
				Host  struct {
					Network struct {
						Name          string `json:"name"`
						BytesSent     int64  `json:"bytes_sent"`
						BytesReceived int64  `json:"bytes_received"`
						Leases        int    `json:"leases"`
					} `json:"network"`
				} `json:"host"`
			}
			getJSON(t, a.base+"/vms/"+app.ID+"/metrics", &met)
			if n := met.Host.Network; n.Name != "default" || n.BytesSent == 0 || n.BytesReceived == 0 || n.Leases != 2 {
				return fmt.Errorf("network metrics %+v", n)
			}
			if met.Guest == nil || met.Guest.Series == 0 {
				return fmt.Errorf("no guest report yet")
			}
			return nil
		})
		var rep struct {
			MediaType string `json:"mediaType"`
			Metrics   []any  `json:"metrics"`
		}
		getJSON(t, a.base+"/vms/"+app.ID+"/report", &rep)
		if rep.MediaType != "application/vnd.io.systemd.report" || len(rep.Metrics) == 0 {
			t.Errorf("report %+v", rep)
		}
	})
	if app.ID == "" {
		t.FailNow()
	}

	t.Run("a spoofing guest learns nothing", func(t *testing.T) {
		a.t = t
		before := droppedFrames(t, a, first.ID)
		// first claims app's address and sends its IMDS traffic from it.
		script := imdsFunc + `dev=$(ip -o link | awk -F': ' '$2 != "lo" {print $2; exit}')
ip addr add ` + app.IP + `/32 dev $dev && ip route add 169.254.169.254/32 dev $dev src ` + app.IP + ` || exit 90
imds user-data; rc=$?
ip route del 169.254.169.254/32; ip addr del ` + app.IP + `/32 dev $dev
exit $rc`
		r := a.sh(first.ID, script)
		if r.ExitCode == 0 || r.ExitCode == 90 || strings.Contains(r.Stdout, "s3cret") {
			t.Errorf("spoofed fetch: %+v", r)
		}
		if after := droppedFrames(t, a, first.ID); after <= before {
			t.Errorf("dropped frames %d -> %d", before, after)
		}
		// Its own address still works: the IMDS answers it with its own data.
		if r := a.sh(first.ID, imdsFunc+"imds instance-id"); r.Stdout != first.ID {
			t.Errorf("own instance-id: %+v", r)
		}
	})

	t.Run("two networks with one CIDR do not see each other", func(t *testing.T) {
		a.t = t
		// The twin network allows egress to one host port only (below).
		hostIP, open, closed := hostListeners(t)
		egress := ""
		if hostIP != "" {
			egress = fmt.Sprintf(`,"egress":[{"cidr":"%s/32","ports":[%d]}]`, hostIP, open)
		}
		if code, _, b := cluster.Do(t, "POST", a.base+"/networks", `{"name":"twin","cidr":"192.168.127.0/24"`+egress+`}`); code != 201 {
			t.Fatalf("create twin: %d %s", code, b)
		}
		twin := a.vm("POST", "/vms", `{"name":"twin-vm","image":"test-guest","network":"twin","require_attestation":false,"memory_mib":384,"cpus":1}`, 201)
		if twin.IP != first.IP {
			t.Errorf("twin-vm has %s, want the first lease of the same CIDR, %s", twin.IP, first.IP)
		}
		probe := "nc -w 3 " + app.IP + " 22 </dev/null | head -c 8"
		if r := a.sh(first.ID, probe); r.Stdout != "SSH-2.0-" {
			t.Errorf("from the same network, app's SSH port: %+v", r)
		}
		if r := a.sh(twin.ID, probe); r.Stdout != "" {
			t.Errorf("from the twin network, app's SSH port answered: %+v", r)
		}
		// Egress: the twin network's rule lets its guest reach one port of
		// the host and nothing else; the default network's policy blocks the
		// host's address only when it is in a private range.
		if hostIP != "" {
			reach := func(port int) string { return fmt.Sprintf("nc -w 3 %s %d </dev/null | head -c 5", hostIP, port) }
			if r := a.sh(twin.ID, reach(open)); r.Stdout != "hello" {
				t.Errorf("egress rule: the guest did not reach %s:%d: %+v", hostIP, open, r)
			}
			before := egressDropped(t, a, twin.ID)
			if r := a.sh(twin.ID, reach(closed)); r.Stdout != "" {
				t.Errorf("egress rule: port %d, which no rule allows, answered: %+v", closed, r)
			}
			if after := egressDropped(t, a, twin.ID); after <= before {
				t.Errorf("egress_dropped of twin-vm %d -> %d", before, after)
			}
			want := "hello"
			if ip := net.ParseIP(hostIP); ip.IsPrivate() || ip.IsLinkLocalUnicast() {
				want = "" // blocked by the default policy
			}
			if r := a.sh(first.ID, reach(closed)); r.Stdout != want {
				t.Errorf("default policy, host address %s: got %+v, want %q", hostIP, r, want)
			}
		}
		expectError(t, "POST", a.base+"/networks", `{"name":"bad","cidr":"10.9.0.0/24","egress":[{"cidr":"127.0.0.1/32"}]}`, 400, apierr.InvalidRequest)
		expectError(t, "DELETE", a.base+"/networks/twin", "", 409, apierr.Conflict)
		a.vm("DELETE", "/vms/"+twin.ID, "", 204)
		if code, _, b := cluster.Do(t, "DELETE", a.base+"/networks/twin", ""); code != 204 {
			t.Errorf("delete twin: %d %s", code, b)
		}
	})

	t.Run("hypervisor SIGKILL keeps network and forwards", func(t *testing.T) {
		a.t = t
		addr := a.forward(app.ID, 22)
		// Tamper with the image's command line while the hypervisor is down;
		// the restarted one loads it.
		c.StopService("hypervisor")
		stem := "test-guest_0.1.0"
		cmdline := filepath.Join(c.ImageDir, stem+".cmdline")
		b, err := os.ReadFile(cmdline)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(cmdline, []byte(strings.TrimSpace(string(b))+" vm-agent.tampered=1"), 0o644); err != nil {
			t.Fatal(err)
		}
		c.StartService("hypervisor")
		c.WaitReady(30 * time.Second)
		if r := a.exec(app.ID, "cat", "/etc/app-secret"); r.Stdout != "s3cret" {
			t.Errorf("exec after the restart: %+v", r)
		}
		if again := a.forward(app.ID, 22); again != addr {
			t.Errorf("forward after the restart is %s, was %s", again, addr)
		}
		if line, err := sshBanner(addr); err != nil || !strings.HasPrefix(line, "SSH-2.0-") {
			t.Errorf("restored forward answered %q, %v", line, err)
		}
	})

	t.Run("a changed command line is rejected naming PCR 9", func(t *testing.T) {
		a.t = t
		v := a.vm("POST", "/vms", `{"name":"tampered","image":"test-guest","memory_mib":384,"cpus":1,"require_attestation":true,"user_data":`+ignitionFile("/etc/tampered", "s3cret")+`}`, 201)
		var att attJSON
		getJSON(t, a.base+"/vms/"+v.ID+"/attestation", &att)
		if att.UserDataReleased || att.Initrd == nil || att.Initrd.Verified || !strings.Contains(att.Initrd.Message, "pcr 9") {
			t.Fatalf("tampered attestation: %+v", att)
		}
		r := a.sh(v.ID, imdsFunc+"imds user-data -v; test -e /etc/tampered && echo present")
		if !strings.Contains(r.Stdout, "HTTP/1.0 503") || strings.Contains(r.Stdout, "present") || strings.Contains(r.Stdout, "s3cret") {
			t.Errorf("tampered guest: %+v", r)
		}
		a.vm("DELETE", "/vms/"+v.ID, "", 204)
	})

	t.Run("delete removes lease, forwards and keys", func(t *testing.T) {
		a.t = t
		v := a.get(app.ID)
		addr := a.forward(app.ID, 22)
		a.vm("DELETE", "/vms/"+app.ID, "", 204)
		if _, err := net.DialTimeout("tcp", addr, 2*time.Second); err == nil {
			t.Errorf("forward %s still listens after delete", addr)
		}
		if _, err := os.Stat(v.Paths.Dir); !os.IsNotExist(err) {
			t.Errorf("vm directory (with its keys) still there: %v", err)
		}
		var def struct {
			Leases []struct{ VMID, IP string } `json:"leases"`
		}
		getJSON(t, a.base+"/networks/default", &def)
		for _, l := range def.Leases {
			if l.IP == app.IP {
				t.Errorf("lease of the deleted vm remains: %+v", def.Leases)
			}
		}
		a.vm("DELETE", "/vms/"+first.ID, "", 204)
	})
}

// imdsFunc defines `imds <key> [-v]` in a guest shell: an HTTP GET with
// busybox nc (the guest has no curl), printing the body (with -v, the
// status line too) and failing unless the status is 200.
const imdsFunc = `imds() {
  resp=$(printf 'GET /giantswarm/v1/%s HTTP/1.0\r\nHost: 169.254.169.254\r\n\r\n' "$1" | nc -w 4 169.254.169.254 80) || return 1
  status=$(printf '%s\n' "$resp" | head -n 1 | tr -d '\r')
  [ "$2" = -v ] && echo "$status"
  printf '%s' "$resp" | tr -d '\r' | sed '1,/^$/d'
  case "$status" in *" 200 "*) return 0;; *) return 1;; esac
}
`

// hostListeners serves "hello" on two ports of the host's first
// non-loopback IPv4 address (the traffic stays on this machine), for the
// egress tests; "" when the host has none.
func hostListeners(t *testing.T) (ip string, open, closed int) {
	t.Helper()
	addrs, _ := net.InterfaceAddrs()
	for _, a := range addrs {
		ipn, ok := a.(*net.IPNet)
		if !ok || ipn.IP.To4() == nil || ipn.IP.IsLoopback() || ipn.IP.IsLinkLocalUnicast() {
			continue
		}
		var ports []int
		for range 2 {
			ln, err := net.Listen("tcp", net.JoinHostPort(ipn.IP.String(), "0"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { ln.Close() })
			go func() {
				for {
					c, err := ln.Accept()
					if err != nil {
						return
					}
					c.Write([]byte("hello"))
					c.Close()
				}
			}()
			ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
		}
		return ipn.IP.String(), ports[0], ports[1]
	}
	t.Log("no non-loopback IPv4 address on this host: the egress checks are skipped")
	return "", 0, 0
}

// egressDropped and droppedFrames are a VM's counters in its metrics.
func egressDropped(t *testing.T, a api, id string) int64 {
	return netCounter(t, a, id, "egress_dropped")
}
func droppedFrames(t *testing.T, a api, id string) int64 {
	return netCounter(t, a, id, "dropped_frames")
}

func netCounter(t *testing.T, a api, id, key string) int64 {
	t.Helper()
	var met struct {
		Host struct {
			Network map[string]any `json:"network"`
		} `json:"host"`
	}
	getJSON(t, a.base+"/vms/"+id+"/metrics", &met)
	v, _ := met.Host.Network[key].(float64) // absent means 0
	return int64(v)
}
