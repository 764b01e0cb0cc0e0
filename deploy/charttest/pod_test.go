package charttest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/tests/cluster"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	corev1 "k8s.io/api/core/v1"
)

// podValues are the values TestRenderedPodRuns renders: the guest image from
// a registry on loopback (plain HTTP), metrics on, and the anonymous API
// chosen explicitly.
func podValues(registry string) string {
	return `
guestImage: {registry: '` + registry + `', repository: vm-manager-guest-image, tag: '0.1.0', plainHTTP: true}
metrics: {enabled: true}
gateway: {allowAnonymousNonLoopback: true}
`
}

// rewriter maps the pod's paths and port to this machine's: the only changes
// made to the rendered commands and environments.
type rewriter struct {
	binDir, state, run, listen string
	port                       int32       // the gateway's container port
	more                       [][2]string // other mounts: pod path, local path
}

func (r rewriter) path(v string) string {
	for _, p := range append([][2]string{{stateDir, r.state}, {runDir, r.run}}, r.more...) {
		if v == p[0] || strings.HasPrefix(v, p[0]+"/") {
			return p[1] + v[len(p[0]):]
		}
	}
	return v
}

func (r rewriter) arg(t *testing.T, a string) string {
	name, val, ok := strings.Cut(a, "=")
	if !ok || !strings.HasPrefix(name, "--") {
		return r.path(a)
	}
	if name == "--listen" {
		host, port, err := net.SplitHostPort(val)
		if err != nil || host != "" || port != fmt.Sprint(r.port) {
			t.Fatalf("the gateway listens on %q, want all addresses on its container port %d", val, r.port)
		}
		return name + "=" + r.listen
	}
	return name + "=" + r.path(val)
}

// process is one container run as a local process.
type process struct {
	name string
	argv []string
	env  []string
	log  string
	cmd  *exec.Cmd
	done chan struct{}
}

// processFor turns a rendered container into a process: its command and args,
// and its environment (plus PATH and HOME, which the image would provide),
// with the paths and the port rewritten; nothing of the test's own
// environment leaks in.
func processFor(t *testing.T, c *corev1.Container, r rewriter, logDir string) *process {
	t.Helper()
	bin := strings.TrimPrefix(c.Command[0], "/usr/local/bin/")
	if bin == c.Command[0] || !strings.HasPrefix(bin, "vmm-") {
		t.Fatalf("%s: command %q is not a /usr/local/bin/vmm-* binary", c.Name, c.Command)
	}
	p := &process{name: c.Name, argv: []string{filepath.Join(r.binDir, bin)}, log: filepath.Join(logDir, c.Name+".log")}
	for _, a := range append(append([]string{}, c.Command[1:]...), c.Args...) {
		p.argv = append(p.argv, r.arg(t, a))
	}
	p.env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}
	for _, e := range c.Env {
		if e.ValueFrom != nil {
			t.Fatalf("%s: env %s comes from %+v, which a local process cannot resolve", c.Name, e.Name, e.ValueFrom)
		}
		p.env = append(p.env, e.Name+"="+r.path(e.Value))
	}
	for _, s := range append(append([]string{}, p.argv[1:]...), p.env[2:]...) {
		for _, podPath := range []string{stateDir, runDir, "/usr/local/bin"} {
			if strings.Contains(s, podPath) {
				t.Fatalf("%s: %q still names the pod's %s", c.Name, s, podPath)
			}
		}
	}
	t.Logf("%s: %s\n  env %s", c.Name, strings.Join(p.argv, " "), strings.Join(p.env[2:], " "))
	return p
}

func (p *process) start(t *testing.T) {
	t.Helper()
	f, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	p.cmd = exec.Command(p.argv[0], p.argv[1:]...)
	p.cmd.Env = p.env
	p.cmd.Stdout, p.cmd.Stderr = f, f
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", p.name, err)
	}
	p.done = make(chan struct{})
	go func() {
		err := p.cmd.Wait()
		fmt.Fprintf(f, "--- %s exited: %v\n", p.name, err)
		f.Close()
		close(p.done)
	}()
}

// stop signals the process and waits for it, SIGKILL after grace.
func (p *process) stop(sig syscall.Signal, grace time.Duration) {
	if p.cmd == nil || p.done == nil {
		return
	}
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

func (p *process) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// hostDirs are the local directories behind a container's mounts of the
// pod's state and runtime directories (a mount of a parent, such as /run,
// counts as the directory it holds).
func hostDirs(c *corev1.Container, r rewriter) []string {
	var out []string
	for _, m := range c.VolumeMounts {
		for _, p := range [][2]string{{stateDir, r.state}, {runDir, r.run}} {
			if m.MountPath == p[0] || strings.HasPrefix(p[0], m.MountPath+"/") {
				out = append(out, p[1])
			} else if strings.HasPrefix(m.MountPath, p[0]+"/") {
				out = append(out, p[1]+m.MountPath[len(p[0]):])
			}
		}
	}
	return out
}

// vmRecord is the part of the REST VM record the test reads.
type vmRecord struct {
	ID        string `json:"id"`
	Name      string `json:"name"`
	State     string `json:"state"`
	LastError string `json:"lastError"`
	Processes *struct {
		Qemu struct{ Pid int } `json:"qemu"`
		Tpm  struct{ Pid int } `json:"tpm"`
	} `json:"processes"`
}

func mustGlob(t *testing.T, pattern string) []string {
	t.Helper()
	m, err := filepath.Glob(pattern)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// call sends a request and fails the test unless the status is want.
func call(t *testing.T, method, url, body string, want int) []byte {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	code, _, b := cluster.DoContext(ctx, t, method, url, body, nil)
	if code != want {
		t.Fatalf("%s %s: %d, want %d: %s", method, url, code, want, b)
	}
	return b
}

// TestRenderedPodRuns checks the chart's wiring, not only its syntax: the
// rendered Deployment's three containers run as local processes with their
// rendered commands, arguments and environments (only the pod's paths and
// port mapped to temporary ones), serve a VM through REST and MCP, and keep
// it across a SIGKILL of the gateway and of attestation.
func TestRenderedPodRuns(t *testing.T) {
	images := cluster.GuestImages(t, "../..")
	start := time.Now()

	// The published guest image: the built test guests (direct-kernel and
	// UKI, with the UKI's policy and the sysupdate tree) pushed by the
	// hypervisor binary to a registry on loopback.
	binDir := t.TempDir()
	if err := cluster.BuildBinaries(binDir); err != nil {
		t.Fatal(err)
	}
	t.Logf("binaries built in %s", time.Since(start).Round(time.Millisecond))
	registry := testRegistry(t)
	published := publishedTree(t, images)
	run(t, filepath.Join(binDir, "vmm-hypervisor"), "image", "push", published, registry+"/vm-manager-guest-image:0.1.0", "--plain-http")

	m, manifest := render(t, values(t, podValues(registry)))
	tpl := checkPod(t, m, manifest)
	pod := &tpl.Spec

	dir := cluster.TempDir(t)
	addr := cluster.FreeAddr(t)
	r := rewriter{binDir: binDir, state: filepath.Join(dir, "state"), run: filepath.Join(dir, "run"), listen: addr,
		port: Container(pod, "gateway").Ports[0].ContainerPort}

	// The init container, as the kubelet runs it before the others: it
	// pulls the guest image into <state>/images, every file unchanged.
	if len(pod.InitContainers) != 1 {
		t.Fatalf("init containers %+v, want the guest-image puller", pod.InitContainers)
	}
	if err := os.MkdirAll(r.state, 0o700); err != nil {
		t.Fatal(err)
	}
	puller := processFor(t, &pod.InitContainers[0], r, dir)
	puller.start(t)
	select {
	case <-puller.done:
	case <-time.After(2 * time.Minute):
		puller.stop(syscall.SIGKILL, time.Second)
		t.Fatal("the guest-image init container did not finish within 2 minutes")
	}
	if code := puller.cmd.ProcessState.ExitCode(); code != 0 {
		b, _ := os.ReadFile(puller.log)
		t.Fatalf("the guest-image init container exited %d:\n%s", code, b)
	}
	sameTree(t, published, r.path(imageDir))
	t.Logf("guest image pulled after %s", time.Since(start).Round(time.Millisecond))

	procs := map[string]*process{}
	var order []string
	for _, c := range pod.Containers {
		procs[c.Name] = processFor(t, &c, r, dir)
		order = append(order, c.Name)
	}
	var vm vmRecord
	t.Cleanup(func() {
		// Gateway first, the hypervisor last: with --detach-vms-on-exit=false
		// its SIGTERM powers down whatever VM is left.
		for i := len(order) - 1; i >= 0; i-- {
			procs[order[i]].stop(syscall.SIGTERM, 45*time.Second)
		}
		if vm.Processes != nil {
			cluster.KillLeftovers(t, vm.Processes.Qemu.Pid, vm.Processes.Tpm.Pid)
		}
		if t.Failed() {
			for _, name := range order {
				b, _ := os.ReadFile(procs[name].log)
				lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
				if len(lines) > 60 {
					lines = lines[len(lines)-60:]
				}
				t.Logf("--- %s log (last %d lines):\n%s", name, len(lines), strings.Join(lines, "\n"))
			}
		}
	})
	// As in a pod, all three start at once, in no particular order.
	for _, name := range order {
		procs[name].start(t)
	}
	base := "http://" + addr
	waitReady := func(what string) {
		t.Helper()
		cluster.Eventually(t, 30*time.Second, "gateway /readyz "+what, func() error {
			for _, name := range order {
				if !procs[name].running() {
					t.Fatalf("%s exited", name)
				}
			}
			return cluster.Readyz(addr)
		})
	}
	waitReady("after start")
	t.Logf("pod ready after %s", time.Since(start).Round(time.Millisecond))

	// The verifier acts without a caller's token: nothing the gateway
	// container mounts may lead to it, while the hypervisor's mounts do.
	for _, name := range []string{"gateway", "hypervisor"} {
		dirs := hostDirs(Container(pod, name), r)
		var reach []string
		for _, s := range cluster.Sockets(dirs...) {
			if cluster.ReachesVerifier(s) {
				reach = append(reach, s)
			}
		}
		t.Logf("%s container mounts %v; sockets there answering the VerifierService: %v", name, dirs, reach)
		if name == "gateway" && len(reach) > 0 {
			t.Errorf("the gateway container reaches the VerifierService at %v", reach)
		}
		if name == "hypervisor" && len(reach) == 0 {
			t.Errorf("the hypervisor container does not reach the VerifierService (mounts %v)", dirs)
		}
	}

	var host struct {
		Ready bool `json:"ready"`
	}
	if err := json.Unmarshal(call(t, "GET", base+"/api/v1/host", "", 200), &host); err != nil {
		t.Fatal(err)
	}
	if metrics := string(call(t, "GET", base+"/metrics", "", 200)); !strings.Contains(metrics, "vm_manager_build_info") {
		t.Errorf("/metrics lacks vm_manager_build_info")
	}

	// The pulled UKI image is in the catalog with its policy.
	if strings.Contains(strings.Join(mustGlob(t, filepath.Join(r.path(imageDir), "*.efi")), " "), "test-guest-uki_") {
		var img struct {
			Kind   string         `json:"kind"`
			Policy map[string]any `json:"policy"`
		}
		if err := json.Unmarshal(call(t, "GET", base+"/api/v1/images/test-guest-uki_0.1.0", "", 200), &img); err != nil {
			t.Fatal(err)
		}
		if img.Policy["pcr11"] == nil || img.Policy["uki"] == nil {
			t.Errorf("the pulled UKI image in the catalog: kind %s, policy %v", img.Kind, img.Policy)
		}
	}

	body := `{"name":"chart","image":"test-guest","require_attestation":false,"memory_mib":384,"cpus":1}`
	if err := json.Unmarshal(call(t, "POST", base+"/api/v1/vms", body, 201), &vm); err != nil {
		t.Fatal(err)
	}
	if vm.State != "ready" || vm.Processes == nil || !cluster.Running(vm.Processes.Qemu.Pid) {
		t.Fatalf("created vm: %+v", vm)
	}
	t.Logf("vm %s ready after %s", vm.ID, time.Since(start).Round(time.Millisecond))

	// MCP through the rendered gateway.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	client := mcp.NewClient(&mcp.Implementation{Name: "vm-manager-charttest", Version: "v0"}, nil)
	cs, err := client.Connect(ctx, &mcp.StreamableClientTransport{Endpoint: base + "/mcp"}, nil)
	if err != nil {
		t.Fatalf("connect to /mcp: %v", err)
	}
	tools, err := cs.ListTools(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	// The original's 20 tools are served (later issues add more).
	names := map[string]bool{}
	for _, tool := range tools.Tools {
		names[tool.Name] = true
	}
	for _, want := range []string{"get_host", "list_vms", "create_vm", "get_vm", "delete_vm", "start_vm", "stop_vm", "exec_vm", "get_vm_console", "forward_port"} {
		if !names[want] {
			t.Errorf("no MCP tool %q among %d", want, len(tools.Tools))
		}
	}
	if len(tools.Tools) < 20 {
		t.Errorf("%d MCP tools, want the original's 20 at least", len(tools.Tools))
	}
	res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "get_vm", Arguments: map[string]any{"id": vm.ID}})
	if err != nil {
		t.Fatal(err)
	}
	var viaMCP vmRecord
	if len(res.Content) != 1 || res.IsError {
		t.Fatalf("get_vm: %+v", res)
	}
	if err := json.Unmarshal([]byte(res.Content[0].(*mcp.TextContent).Text), &viaMCP); err != nil || viaMCP.State != "ready" || viaMCP.ID != vm.ID {
		t.Fatalf("get_vm: %v %+v", err, viaMCP)
	}
	cs.Close()

	// A crash of the gateway and of attestation: the kubelet would restart
	// each container with the same command and environment.
	for _, name := range []string{"gateway", "attestation"} {
		procs[name].stop(syscall.SIGKILL, 10*time.Second)
	}
	if !procs["hypervisor"].running() {
		t.Fatal("the hypervisor ended with the others")
	}
	for _, name := range []string{"attestation", "gateway"} {
		procs[name].start(t)
	}
	waitReady("after the restart of gateway and attestation")
	var again vmRecord
	if err := json.Unmarshal(call(t, "GET", base+"/api/v1/vms/"+vm.ID, "", 200), &again); err != nil {
		t.Fatal(err)
	}
	if again.State != "ready" || again.Processes == nil || again.Processes.Qemu.Pid != vm.Processes.Qemu.Pid {
		t.Fatalf("vm after the restart: %+v (was qemu pid %d)", again, vm.Processes.Qemu.Pid)
	}
	call(t, "GET", base+"/api/v1/attestation", "", 200) // the restarted attestation, through the gateway
	var out struct {
		Stdout   string `json:"stdout"`
		ExitCode int    `json:"exitCode"`
	}
	if err := json.Unmarshal(call(t, "POST", base+"/api/v1/vms/"+vm.ID+"/exec", `{"command":["hostname"]}`, 200), &out); err != nil {
		t.Fatal(err)
	}
	if out.Stdout != "chart\n" || out.ExitCode != 0 {
		t.Fatalf("exec hostname: %+v", out)
	}

	call(t, "DELETE", base+"/api/v1/vms/"+vm.ID, "", 204)
	cluster.Eventually(t, 15*time.Second, "qemu exit", func() error {
		if cluster.Running(vm.Processes.Qemu.Pid) {
			return errors.New("qemu still running")
		}
		return nil
	})
	t.Logf("done after %s", time.Since(start).Round(time.Millisecond))
}
