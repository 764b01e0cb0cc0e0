package tests

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/tests/cluster"
)

// hostSide is a set of addresses the test adds to this host's loopback
// interface, each serving "hello <addr>" on one TCP port and counting what
// reaches it over TCP and UDP. A guest reaching one of them went through the
// NAT to the host; nothing here leaves the machine.
type hostSide struct {
	t      *testing.T
	port   int // TCP and UDP, on every address
	closed int // a port nothing listens on
	mu     sync.Mutex
	hits   map[string]int
}

// addHostAddrs adds addrs (as /32) to lo for the test's life; without root or
// `ip` the test is skipped.
func addHostAddrs(t *testing.T, addrs ...string) *hostSide {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to add addresses to lo")
	}
	h := &hostSide{t: t, hits: map[string]int{}}
	for _, a := range addrs {
		if out, err := exec.Command("ip", "addr", "add", a+"/32", "dev", "lo").CombinedOutput(); err != nil {
			t.Skipf("ip addr add %s/32 dev lo: %v: %s", a, err, out)
		}
		t.Cleanup(func() { _ = exec.Command("ip", "addr", "del", a+"/32", "dev", "lo").Run() })
	}
	// One port free on every address: the first address's, retried.
	for try := 0; ; try++ {
		if try == 20 {
			t.Fatal("no port free on every test address")
		}
		ln, err := net.Listen("tcp", net.JoinHostPort(addrs[0], "0"))
		if err != nil {
			t.Fatal(err)
		}
		h.port = ln.Addr().(*net.TCPAddr).Port
		lns := []net.Listener{ln}
		var pcs []net.PacketConn
		ok := true
		for i, a := range addrs {
			if i > 0 {
				l, err := net.Listen("tcp", net.JoinHostPort(a, fmt.Sprint(h.port)))
				if err != nil {
					ok = false
					break
				}
				lns = append(lns, l)
			}
			pc, err := net.ListenPacket("udp", net.JoinHostPort(a, fmt.Sprint(h.port)))
			if err != nil {
				ok = false
				break
			}
			pcs = append(pcs, pc)
		}
		if !ok {
			for _, l := range lns {
				l.Close()
			}
			for _, pc := range pcs {
				pc.Close()
			}
			continue
		}
		for i, l := range lns {
			t.Cleanup(func() { l.Close() })
			go h.serveTCP(addrs[i], l)
		}
		for i, pc := range pcs {
			t.Cleanup(func() { pc.Close() })
			go h.serveUDP(addrs[i], pc)
		}
		break
	}
	// A closed port: bound once, then released.
	l, err := net.Listen("tcp", net.JoinHostPort(addrs[0], "0"))
	if err != nil {
		t.Fatal(err)
	}
	h.closed = l.Addr().(*net.TCPAddr).Port
	l.Close()
	return h
}

func (h *hostSide) serveTCP(addr string, ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		h.hit(addr)
		_, _ = c.Write([]byte("hello " + addr))
		c.Close()
	}
}

func (h *hostSide) serveUDP(addr string, pc net.PacketConn) {
	buf := make([]byte, 2048)
	for {
		k, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		h.hit(addr)
		_, _ = pc.WriteTo(append([]byte("hello "+addr+" "), buf[:k]...), from)
	}
}

func (h *hostSide) hit(addr string) {
	h.mu.Lock()
	h.hits[addr]++
	h.mu.Unlock()
}

func (h *hostSide) reached(addr string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.hits[addr]
}

// testPrefix picks 10.<x> with x in 200..249 that no address of this host
// is in, so parallel test runs and the host's own networks do not collide.
func testPrefix(t *testing.T) string {
	t.Helper()
	addrs, _ := net.InterfaceAddrs()
	for range 100 {
		p := fmt.Sprintf("10.%d.", 200+rand.IntN(50))
		used := false
		for _, a := range addrs {
			if strings.HasPrefix(a.String(), p) {
				used = true
			}
		}
		if !used {
			return p
		}
	}
	t.Fatal("no free 10.x/16 for the test")
	return ""
}

// openFDs counts a process's open descriptors.
func openFDs(t *testing.T, pid int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// netMetric is one field of a VM's network metrics: a number, or a map's entry
// ("nat_refused.udp_vm_limit"); absent is 0.
func netMetric(t *testing.T, a api, id, key string) int64 {
	t.Helper()
	var met struct {
		Host struct {
			Network map[string]any `json:"network"`
		} `json:"host"`
	}
	getJSON(t, a.base+"/vms/"+id+"/metrics", &met)
	var v any = met.Host.Network
	for _, k := range strings.Split(key, ".") {
		m, _ := v.(map[string]any)
		v = m[k]
	}
	f, _ := v.(float64)
	return int64(f)
}

// reachScript defines `reach <ip> <port>` in a guest shell: what a TCP
// connection to it reads (nothing when it is dropped or refused).
const reachScript = `reach() { nc -w 3 "$1" "$2" </dev/null 2>/dev/null | head -c 64; }
dev=$(ip -o link | awk -F': ' '$2 != "lo" {print $2; exit}')
`

// TestEgress is issue 16's network part from inside real guests: a network
// whose CIDR holds addresses of this host (its gateway, host alias, a free
// pool address and another VM's address, each listening here) does not
// reach them, counted; a UDP flood from one guest is bounded by the per-VM
// NAT flow limit while the other guest keeps its NAT, IMDS and exec; domain
// rules allow only what the network's DNS answered; DNS obeys the policy;
// and the IMDS bounds one guest's connections.
func TestEgress(t *testing.T) {
	images := cluster.GuestImages(t, "..")
	p := testPrefix(t)
	gw, alias, free, vmB := p+"0.1", p+"0.254", p+"0.77", p+"0.3"
	target := p + "1.10" // outside the network, allowed by its rule
	apiIP, evil, svc := p+"3.10", p+"3.20", p+"3.30"
	host := addHostAddrs(t, gw, alias, free, vmB, target, apiIP, evil, svc)

	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, Env: []string{
		"VM_MANAGER_MAX_NAT_FLOWS_UDP=64",
		"VM_MANAGER_NAT_UDP_IDLE_TIMEOUT=5s",
		"VM_MANAGER_IMDS_READ_TIMEOUT=5s",
	}})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })

	if code, _, b := cluster.Do(t, "POST", a.base+"/networks", fmt.Sprintf(`{"name":"overlap","cidr":"%s0.0/24","egress":[{"cidr":"%s1.0/24"}],
		"dns_records":[{"name":"target.vmm.test","ip":"%s"}]}`, p, p, target)); code != 201 {
		t.Fatalf("create overlap: %d %s", code, b)
	}
	dom := fmt.Sprintf(`{"name":"dom","cidr":"%[1]s2.0/24","dns_policy":"rules",
		"dns_records":[{"name":"api.vmm.test","ip":"%[2]s"},{"name":"evil.vmm.test","ip":"%[3]s"},{"name":"x.svc.vmm.test","ip":"%[4]s"}],
		"egress":[{"domain":"api.vmm.test","ports":[%[5]d]},{"domain":"*.svc.vmm.test"}]}`, p, apiIP, evil, svc, host.port)
	code, _, b := cluster.Do(t, "POST", a.base+"/networks", dom)
	if code != 201 || !strings.Contains(string(b), `"dnsPolicy": "rules"`) || !strings.Contains(string(b), `"domain": "*.svc.vmm.test"`) {
		t.Fatalf("create dom: %d %s", code, b)
	}
	vmA := a.vm("POST", "/vms", `{"name":"a","image":"test-guest","network":"overlap","require_attestation":false,"memory_mib":384,"cpus":1}`, 201)
	vmb := a.vm("POST", "/vms", `{"name":"b","image":"test-guest","network":"overlap","require_attestation":false,"memory_mib":384,"cpus":1}`, 201)
	vmC := a.vm("POST", "/vms", `{"name":"c","image":"test-guest","network":"dom","require_attestation":false,"memory_mib":384,"cpus":1}`, 201)
	if vmA.IP != p+"0.2" || vmb.IP != vmB {
		t.Fatalf("leases %s and %s, want %s0.2 and %s", vmA.IP, vmb.IP, p, vmB)
	}

	t.Run("the network's own addresses do not reach the host", func(t *testing.T) {
		a.t = t
		reach := func(ip string) string { return fmt.Sprintf("reach %s %d", ip, host.port) }
		// The positive control: the rule's range is reached through the NAT.
		if r := a.sh(vmA.ID, reachScript+reach(target)); r.Stdout != "hello "+target {
			t.Fatalf("allowed destination %s: %+v", target, r)
		}
		before := egressDropped(t, a, vmA.ID)
		beforeLocal := netMetric(t, a, vmA.ID, "egress_dropped_by_reason.local")
		// The gateway's other ports, over TCP and UDP (busybox tftp is the
		// guest's UDP client); then, routed through the gateway, the host
		// alias, a free address and b's address.
		script := reachScript + fmt.Sprintf(`echo "gw=$(%s)"
busybox tftp -g -r x -l /tmp/x %s %d >/dev/null 2>&1 & sleep 3; kill $! 2>/dev/null
for ip in %s %s %s; do ip route add $ip/32 via %s dev $dev; echo "$ip=$(reach $ip %d)"; ip route del $ip/32; done
`, reach(gw), gw, host.port, alias, free, vmB, gw, host.port)
		r := a.sh(vmA.ID, script)
		t.Logf("guest saw:\n%s", r.Stdout)
		for _, ip := range []string{gw, alias, free, vmB} {
			if n := host.reached(ip); n != 0 {
				t.Errorf("the host's %s was reached %d times from the guest", ip, n)
			}
		}
		if strings.Contains(r.Stdout, "hello") {
			t.Errorf("the guest got answers from the host: %s", r.Stdout)
		}
		after, afterLocal := egressDropped(t, a, vmA.ID), netMetric(t, a, vmA.ID, "egress_dropped_by_reason.local")
		t.Logf("egress_dropped %d -> %d, of which local %d -> %d", before, after, beforeLocal, afterLocal)
		if after <= before || afterLocal <= beforeLocal {
			t.Errorf("drops not counted: egress_dropped %d -> %d, local %d -> %d", before, after, beforeLocal, afterLocal)
		}
		// What the network serves stays: VM-to-VM on the switch, DNS at the
		// gateway (its own record: this machine has no resolver to ask),
		// exec (the network's own connection to the guest).
		if r := a.sh(vmA.ID, "nc -w 3 "+vmb.IP+" 22 </dev/null | head -c 8"); r.Stdout != "SSH-2.0-" {
			t.Errorf("VM to VM: %+v", r)
		}
		if r := a.sh(vmA.ID, "nslookup target.vmm.test "+gw); !strings.Contains(r.Stdout, "Address: "+target) {
			t.Errorf("DNS at the gateway: %+v", r)
		}
	})

	t.Run("a UDP flood is bounded and the other VM keeps working", func(t *testing.T) {
		a.t = t
		pid := c.Pid("hypervisor")
		fds0 := openFDs(t, pid)
		// 30 parallel traceroutes, 30 probes each: 900 UDP flows to this host.
		r := a.sh(vmA.ID, fmt.Sprintf(`for i in $(seq 30); do busybox traceroute -n -q 1 -w 1 -m 30 %s >/dev/null 2>&1 </dev/null & done; echo started`, target))
		if r.Stdout != "started\n" {
			t.Fatalf("flood: %+v", r)
		}
		start := time.Now()
		maxFDs, maxFlows := fds0, int64(0)
		checked := false
		for time.Since(start) < 60*time.Second {
			maxFDs = max(maxFDs, openFDs(t, pid))
			maxFlows = max(maxFlows, netMetric(t, a, vmA.ID, "nat_udp_flows"))
			if !checked && time.Since(start) > 8*time.Second {
				checked = true
				// Meanwhile, b's NAT, IMDS and exec work.
				if r := a.sh(vmb.ID, reachScript+fmt.Sprintf("reach %s %d", target, host.port)); r.Stdout != "hello "+target {
					t.Errorf("b's NAT during the flood: %+v", r)
				}
				if r := a.sh(vmb.ID, imdsFunc+"imds instance-id"); r.Stdout != vmb.ID {
					t.Errorf("b's IMDS during the flood: %+v", r)
				}
			}
			if r := a.sh(vmA.ID, "ps | grep -c '[t]raceroute'"); r.Stdout == "0\n" {
				break
			}
			time.Sleep(time.Second)
		}
		refused := netMetric(t, a, vmA.ID, "nat_refused.udp_vm_limit")
		t.Logf("flood of %v: hypervisor descriptors %d before, at most %d during; a's UDP flows at most %d; refused %d",
			time.Since(start).Round(time.Second), fds0, maxFDs, maxFlows, refused)
		if maxFDs-fds0 > 64+20 {
			t.Errorf("descriptors grew by %d, more than the bound of 64 UDP flows allows", maxFDs-fds0)
		}
		if refused == 0 || maxFlows > 64 {
			t.Errorf("flows at most %d, refused %d: want at most 64 and some refused", maxFlows, refused)
		}
		if n := netMetric(t, a, vmb.ID, "nat_refused.udp_vm_limit"); n != 0 {
			t.Errorf("b's refused flows: %d", n)
		}
		// Idle flows end after --nat-udp-idle-timeout (5 s here).
		cluster.Eventually(t, 30*time.Second, "idle UDP flows closed", func() error {
			if n := netMetric(t, a, vmA.ID, "nat_udp_flows"); n != 0 {
				return fmt.Errorf("%d UDP flows", n)
			}
			return nil
		})
		t.Logf("descriptors after the idle timeout: %d", openFDs(t, pid))
		// The refusals reach the gateway's /metrics.
		_, _, m := cluster.Do(t, "GET", "http://"+c.Addr+"/metrics", "")
		if want := fmt.Sprintf(`vm_manager_network_nat_refused_total{network="overlap",reason="udp_vm_limit",vm="%s"} %d`, vmA.ID, refused); !strings.Contains(string(m), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	})

	t.Run("domain rules allow what the network's DNS answered", func(t *testing.T) {
		a.t = t
		gwC := p + "2.1"
		look := func(name string) string {
			return fmt.Sprintf(`nslookup %s %s 2>&1 | tail -n +3 | grep -E "Address|REFUSED|can't" | head -1`, name, gwC)
		}
		reach := func(ip string) string { return fmt.Sprintf("reach %s %d", ip, host.port) }
		before := netMetric(t, a, vmC.ID, "egress_dropped_by_reason.rule")
		script := reachScript + strings.Join([]string{
			`echo "api-before=$(` + reach(apiIP) + `)"`,
			`echo "lookup-api=$(` + look("api.vmm.test") + `)"`,
			`echo "api=$(` + reach(apiIP) + `)"`,
			`echo "api-other-port=$(reach ` + apiIP + ` ` + fmt.Sprint(host.closed) + `)"`,
			`echo "lookup-evil=$(` + look("evil.vmm.test") + `)"`,
			`echo "evil=$(` + reach(evil) + `)"`,
			`echo "lookup-svc=$(` + look("x.svc.vmm.test") + `)"`,
			`echo "svc=$(` + reach(svc) + `)"`,
			`echo "lookup-other=$(` + look("localhost") + `)"`,
		}, "\n")
		r := a.sh(vmC.ID, script)
		t.Logf("guest saw:\n%s", r.Stdout)
		want := map[string]string{
			"api-before": "", "api": "hello " + apiIP, "api-other-port": "",
			"evil": "", "svc": "hello " + svc,
		}
		got := map[string]string{}
		for _, line := range strings.Split(strings.TrimSpace(r.Stdout), "\n") {
			k, v, _ := strings.Cut(line, "=")
			got[k] = v
		}
		for k, v := range want {
			if got[k] != v {
				t.Errorf("%s: %q, want %q", k, got[k], v)
			}
		}
		if !strings.Contains(got["lookup-api"], apiIP) || !strings.Contains(got["lookup-evil"], evil) || !strings.Contains(got["lookup-svc"], svc) {
			t.Errorf("lookups: %v", got)
		}
		if !strings.Contains(got["lookup-other"], "REFUSED") {
			t.Errorf("a name no rule matches was resolved: %q", got["lookup-other"])
		}
		if n := host.reached(evil); n != 0 {
			t.Errorf("the answered but unpinned %s was reached %d times", evil, n)
		}
		if n := host.reached(apiIP); n != 1 {
			t.Errorf("%s reached %d times, want once (after the lookup)", apiIP, n)
		}
		if after := netMetric(t, a, vmC.ID, "egress_dropped_by_reason.rule"); after < before+3 {
			t.Errorf("rule drops %d -> %d, want the 3 refused connections counted", before, after)
		}
		if n := netMetric(t, a, vmC.ID, "dns_refused.policy"); n == 0 {
			t.Errorf("refused lookups not counted")
		}
	})

	t.Run("one VM's IMDS connections are bounded", func(t *testing.T) {
		a.t = t
		// 20 connections that send nothing: 16 are held until the read
		// timeout (5 s here), the rest closed at once.
		r := a.sh(vmb.ID, `for i in $(seq 20); do (sleep 30 | nc 169.254.169.254 80 >/dev/null 2>&1 &) ; done; sleep 2; echo held`)
		if r.Stdout != "held\n" {
			t.Fatalf("holding connections: %+v", r)
		}
		refused := netMetric(t, a, vmb.ID, "imds_connections_refused")
		if refused < 4 {
			t.Errorf("refused IMDS connections %d, want at least 4", refused)
		}
		if r := a.sh(vmA.ID, imdsFunc+"imds instance-id"); r.Stdout != vmA.ID {
			t.Errorf("a's IMDS while b is at its bound: %+v", r)
		}
		// The guest's agent may hold one slot with a kept-alive connection.
		cluster.Eventually(t, 30*time.Second, "held connections timed out", func() error {
			if n := netMetric(t, a, vmb.ID, "imds_connections_timed_out"); n < 20-refused-1 {
				return fmt.Errorf("%d of %d timed out", n, 20-refused)
			}
			return nil
		})
		t.Logf("b's IMDS connections: %d refused at once, %d timed out", refused, netMetric(t, a, vmb.ID, "imds_connections_timed_out"))
		if r := a.sh(vmb.ID, imdsFunc+"imds instance-id"); r.Stdout != vmb.ID {
			t.Errorf("b's IMDS after the timeouts: %+v", r)
		}
	})
}
