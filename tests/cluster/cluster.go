// Package cluster starts vm-manager's three processes for tests, either as
// the real binaries (separate processes over unix sockets, as in the pod) or
// in-process (the same server packages on goroutines), so one test body runs
// against both, etcd-style.
package cluster

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/pkg/identity"
	attestation "github.com/giantswarm/vm-manager/services/attestation/server"
	gateway "github.com/giantswarm/vm-manager/services/gateway/server"
	hypervisor "github.com/giantswarm/vm-manager/services/hypervisor/server"
)

// Services in start order.
var Services = []string{"attestation", "hypervisor", "gateway"}

// Options configure a cluster.
type Options struct {
	// ImageDir is the hypervisor's image catalog; default <state>/images.
	ImageDir string
	// Quiet sends the services' logs to <Dir>/<service>.log instead of the
	// test log (benchmarks, whose log is always printed).
	Quiet bool
	// LearnGolden starts attestation in learn mode (PCRs without a golden
	// value are accepted and listed as learned); SetLearnGolden changes it
	// for the next start of the service.
	LearnGolden bool
	// OIDCIssuer and OIDCAudiences turn identity on in all three services
	// (--oidc-issuer, --oidc-audiences): every API call then needs a token.
	OIDCIssuer    string
	OIDCAudiences []string
	// OIDCJWKSRefreshInterval is --oidc-jwks-refresh-interval (0: the
	// default); it also caps the minimum time between JWKS fetches.
	OIDCJWKSRefreshInterval time.Duration
	// PublicURL and OIDCScopes are the gateway's --public-url and
	// --oidc-scopes (its protected resource metadata).
	PublicURL  string
	OIDCScopes []string
	// AllowedHosts is the gateway's --allowed-hosts.
	AllowedHosts []string
	// LogLevel is the services' log level (VM_MANAGER_LOG_LEVEL); default
	// debug. Load tests use info: no per-request lines.
	LogLevel string
	// StopVMsOnExit starts the hypervisor with --detach-vms-on-exit=false:
	// a graceful stop powers its VMs down (the pod's behaviour).
	StopVMsOnExit bool
	// Env adds NAME=value settings to the services' environments: the
	// binaries' flags by their variables (Processes mode only; SetEnv
	// changes them for the next start of a service).
	Env []string
	// TLSCertFile, TLSKeyFile: the gateway serves over TLS (Processes mode
	// only); TLSCAFile verifies it for WaitReady.
	TLSCertFile, TLSKeyFile, TLSCAFile string
}

// Cluster is a running set of the three services.
type Cluster struct {
	Dir      string // everything lives below it
	StateDir string
	RunDir   string
	ImageDir string
	Addr     string // the gateway's host:port

	t       testing.TB
	procs   map[string]proc
	binDir  string // process mode when set
	mu      sync.Mutex
	logs    *logSink
	options Options
}

type proc interface {
	stop() error
}

// Mode is how the services run.
type Mode string

const (
	InProcess Mode = "inprocess"
	Processes Mode = "processes"
)

// Start runs the three services. binDir holds vmm-attestation, vmm-hypervisor
// and vmm-gateway for Processes mode.
func Start(t testing.TB, mode Mode, binDir string, opts Options) *Cluster {
	t.Helper()
	dir := TempDir(t)
	c := &Cluster{
		Dir:      dir,
		StateDir: filepath.Join(dir, "state"),
		RunDir:   filepath.Join(dir, "run"),
		t:        t,
		procs:    map[string]proc{},
		logs:     &logSink{t: t, quiet: opts.Quiet, dir: dir},
		options:  opts,
	}
	c.ImageDir = opts.ImageDir
	if c.ImageDir == "" {
		c.ImageDir = filepath.Join(c.StateDir, "images")
	}
	if mode == Processes {
		c.binDir = binDir
	} else if len(opts.Env) > 0 {
		t.Fatalf("cluster.Options.Env %q needs Processes mode", opts.Env)
	}
	c.Addr = FreeAddr(t)
	t.Cleanup(c.StopAll)
	for _, s := range Services {
		c.StartService(s)
	}
	c.WaitReady(30 * time.Second)
	return c
}

// Socket returns a backend's unix socket in the runtime directory.
func (c *Cluster) Socket(service string) string {
	return filepath.Join(c.RunDir, service+".sock")
}

// VerifierSocket is attestation's hypervisor-only VerifierService, in the
// state directory.
func (c *Cluster) VerifierSocket() string {
	return filepath.Join(c.StateDir, "verifier.sock")
}

func (c *Cluster) env() []string {
	level := c.options.LogLevel
	if level == "" {
		level = "debug"
	}
	env := []string{
		"VM_MANAGER_STATE_DIR=" + c.StateDir,
		"VM_MANAGER_RUN_DIR=" + c.RunDir,
		"VM_MANAGER_IMAGE_DIR=" + c.ImageDir,
		"VM_MANAGER_LISTEN=" + c.Addr,
		"VM_MANAGER_LOG_LEVEL=" + level,
		fmt.Sprintf("VM_MANAGER_ATTESTATION_LEARN_GOLDEN=%t", c.options.LearnGolden),
		fmt.Sprintf("VM_MANAGER_ATTESTATION_LEARN_GOLDEN_ACKNOWLEDGE=%t", c.options.LearnGolden),
		"VM_MANAGER_METRICS_ENABLED=true",
		"VM_MANAGER_OIDC_ISSUER=" + c.options.OIDCIssuer,
		"VM_MANAGER_OIDC_AUDIENCES=" + strings.Join(c.options.OIDCAudiences, ","),
		"VM_MANAGER_ALLOWED_HOSTS=" + strings.Join(c.options.AllowedHosts, ","),
	}
	if c.options.PublicURL != "" {
		env = append(env, "VM_MANAGER_PUBLIC_URL="+c.options.PublicURL)
	}
	if len(c.options.OIDCScopes) > 0 {
		env = append(env, "VM_MANAGER_OIDC_SCOPES="+strings.Join(c.options.OIDCScopes, ","))
	}
	if c.options.OIDCJWKSRefreshInterval != 0 {
		env = append(env, "VM_MANAGER_OIDC_JWKS_REFRESH_INTERVAL="+c.options.OIDCJWKSRefreshInterval.String())
	}
	if c.options.StopVMsOnExit {
		env = append(env, "VM_MANAGER_DETACH_VMS_ON_EXIT=false")
	}
	if c.options.TLSCertFile != "" {
		env = append(env, "VM_MANAGER_TLS_CERT_FILE="+c.options.TLSCertFile, "VM_MANAGER_TLS_KEY_FILE="+c.options.TLSKeyFile)
	}
	return append(env, c.options.Env...)
}

// identity is the services' in-process identity configuration.
func (c *Cluster) identity() identity.Config {
	return identity.Config{Issuer: c.options.OIDCIssuer, Audiences: c.options.OIDCAudiences, JWKSRefreshInterval: c.options.OIDCJWKSRefreshInterval}
}

// SetLearnGolden sets attestation's learn mode for its next start.
func (c *Cluster) SetLearnGolden(on bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.options.LearnGolden = on
}

// SetEnv replaces Options.Env for the next start of a service.
func (c *Cluster) SetEnv(env ...string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.options.Env = env
}

// SetStopVMsOnExit sets the hypervisor's --detach-vms-on-exit=false for its
// next start.
func (c *Cluster) SetStopVMsOnExit(on bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.options.StopVMsOnExit = on
}

// StartService starts one service (again).
func (c *Cluster) StartService(name string) {
	c.t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.procs[name]; ok {
		c.t.Fatalf("%s is already running", name)
	}
	if c.binDir != "" {
		c.procs[name] = c.startProcess(name)
	} else {
		c.procs[name] = c.startInProcess(name)
	}
	if name != "gateway" {
		waitFor(c.t, 20*time.Second, name+" socket", func() error {
			conn, err := net.Dial("unix", c.Socket(name))
			if err == nil {
				conn.Close()
			}
			return err
		})
	}
}

// StopService stops one service: SIGKILL for a process (a crash, not a
// drain), context cancellation in-process.
func (c *Cluster) StopService(name string) {
	c.t.Helper()
	c.mu.Lock()
	p, ok := c.procs[name]
	delete(c.procs, name)
	c.mu.Unlock()
	if !ok {
		c.t.Fatalf("%s is not running", name)
	}
	if err := p.stop(); err != nil {
		c.t.Logf("stop %s: %v", name, err)
	}
}

// StopServiceGracefully sends a process SIGTERM (in-process: cancels its
// context) and waits up to timeout for it to exit; it returns the exit code
// (-1 when it had to be killed after the timeout or died of a signal).
func (c *Cluster) StopServiceGracefully(name string, timeout time.Duration) (exitCode int) {
	c.t.Helper()
	c.mu.Lock()
	p, ok := c.procs[name]
	delete(c.procs, name)
	c.mu.Unlock()
	if !ok {
		c.t.Fatalf("%s is not running", name)
	}
	switch p := p.(type) {
	case *osProc:
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
			return p.cmd.ProcessState.ExitCode()
		case <-time.After(timeout):
			c.t.Errorf("%s did not exit within %s of SIGTERM; killing it", name, timeout)
			_ = p.stop()
			return -1
		}
	case *goProc:
		p.cancel()
		select {
		case err := <-p.done:
			if err != nil {
				c.t.Logf("%s: %v", name, err)
				return 1
			}
			return 0
		case <-time.After(timeout):
			c.t.Errorf("%s did not stop within %s", name, timeout)
			return -1
		}
	}
	return -1
}

// Pid is a service's process id (0 in-process or when it is not running).
func (c *Cluster) Pid(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if p, ok := c.procs[name].(*osProc); ok {
		return p.cmd.Process.Pid
	}
	return 0
}

// StopAll stops everything, gateway first.
func (c *Cluster) StopAll() {
	for i := len(Services) - 1; i >= 0; i-- {
		c.mu.Lock()
		p, ok := c.procs[Services[i]]
		delete(c.procs, Services[i])
		c.mu.Unlock()
		if ok {
			_ = p.stop()
		}
	}
	c.logs.close()
}

// WaitReady waits until /readyz answers 200.
func (c *Cluster) WaitReady(d time.Duration) {
	c.t.Helper()
	if c.options.TLSCAFile != "" {
		client, err := TLSClient(c.options.TLSCAFile)
		if err != nil {
			c.t.Fatal(err)
		}
		waitFor(c.t, d, "gateway /readyz", func() error { return readyzWith(client, "https://"+c.Addr) })
		return
	}
	waitFor(c.t, d, "gateway /readyz", func() error { return Readyz(c.Addr) })
}

type osProc struct {
	cmd  *exec.Cmd
	done chan struct{}
}

func (p *osProc) stop() error {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
	return nil
}

func (c *Cluster) startProcess(name string) proc {
	bin := filepath.Join(c.binDir, "vmm-"+name)
	cmd := exec.Command(bin, "serve")
	cmd.Env = append(os.Environ(), c.env()...)
	w := c.logs.writer(name)
	cmd.Stdout, cmd.Stderr = w, w
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("start %s: %v", bin, err)
	}
	p := &osProc{cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(p.done) }()
	return p
}

type goProc struct {
	cancel context.CancelFunc
	done   chan error
}

func (p *goProc) stop() error {
	p.cancel()
	select {
	case err := <-p.done:
		return err
	case <-time.After(20 * time.Second):
		return fmt.Errorf("did not stop within 20s")
	}
}

func (c *Cluster) startInProcess(name string) proc {
	ctx, cancel := context.WithCancel(context.Background())
	log := slog.New(slog.NewTextHandler(c.logs.writer(name), &slog.HandlerOptions{Level: slog.LevelDebug})).With("process", name)
	p := &goProc{cancel: cancel, done: make(chan error, 1)}
	var run func() error
	switch name {
	case "attestation":
		run = func() error {
			return attestation.Run(ctx, attestation.Config{StateDir: c.StateDir, Socket: c.Socket(name), VerifierSocket: c.VerifierSocket(), Mode: "verify",
				LearnGolden: c.options.LearnGolden, LearnGoldenAcknowledged: c.options.LearnGolden, Identity: c.identity()}, log)
		}
	case "hypervisor":
		run = func() error {
			// The binary's defaults, spelled out.
			return hypervisor.Run(ctx, hypervisor.Config{StateDir: c.StateDir, ImageDir: c.ImageDir, Socket: c.Socket(name), VerifierSocket: c.VerifierSocket(),
				DefaultNetwork: "default", DefaultSubnet: "192.168.127.0/24", Identity: c.identity(), StopVMsOnExit: c.options.StopVMsOnExit}, log)
		}
	case "gateway":
		run = func() error {
			return gateway.Run(ctx, gateway.Config{Listen: c.Addr, HypervisorSocket: c.Socket("hypervisor"), AttestationSocket: c.Socket("attestation"), Identity: c.identity(), Resource: identity.ResourceConfig{PublicURL: c.options.PublicURL, Scopes: c.options.OIDCScopes}, MetricsEnabled: true, AllowedHosts: c.options.AllowedHosts}, log)
		}
	default:
		c.t.Fatalf("unknown service %q", name)
	}
	go func() {
		err := run()
		if err != nil && ctx.Err() == nil {
			c.t.Logf("%s exited: %v", name, err)
		}
		p.done <- err
	}()
	return p
}

func waitFor(t testing.TB, d time.Duration, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(d)
	var err error
	for time.Now().Before(deadline) {
		if err = f(); err == nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("%s not ready within %s: %v", what, d, err)
}

// Eventually retries f until it succeeds or d passes.
func Eventually(t testing.TB, d time.Duration, what string, f func() error) {
	t.Helper()
	waitFor(t, d, what, f)
}

// logSink prefixes each service's output and sends it to t.Log until the test ends.
type logSink struct {
	t      testing.TB
	quiet  bool
	dir    string
	mu     sync.Mutex
	closed bool
}

func (l *logSink) writer(name string) io.Writer {
	if l.quiet {
		f, err := os.OpenFile(filepath.Join(l.dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
		if err == nil {
			return f // closed with the process; a leaked fd per restart in a test is fine
		}
	}
	return writerFunc(func(p []byte) (int, error) {
		l.mu.Lock()
		defer l.mu.Unlock()
		if !l.closed {
			for _, line := range strings.Split(strings.TrimRight(string(p), "\n"), "\n") {
				l.t.Logf("[%s] %s", name, line)
			}
		}
		return len(p), nil
	})
}

func (l *logSink) close() {
	l.mu.Lock()
	l.closed = true
	l.mu.Unlock()
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// BuildBinaries builds the three binaries, and the guest's vm-agent, into
// dir with the workspace's code.
func BuildBinaries(dir string) error {
	pkgs := map[string]string{"vm-agent": "github.com/giantswarm/vm-manager/guest/cmd/vm-agent"}
	for _, s := range Services {
		pkgs["vmm-"+s] = "github.com/giantswarm/vm-manager/services/" + s + "/cmd/vmm-" + s
	}
	for name, pkg := range pkgs {
		cmd := exec.Command("go", "build", "-o", filepath.Join(dir, name), pkg)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("build %s: %v\n%s", name, err, out)
		}
	}
	return nil
}
