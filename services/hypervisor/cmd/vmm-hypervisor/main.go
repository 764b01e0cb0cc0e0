// Command vmm-hypervisor supervises QEMU and swtpm: VMs, networks, the IMDS
// and the image catalog, served as gRPC on a unix socket.
package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"time"

	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/labels"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/giantswarm/vm-manager/pkg/observe"
	"github.com/giantswarm/vm-manager/pkg/statedir"
	"github.com/giantswarm/vm-manager/pkg/tracing"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/execstream"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/guestapi"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/host"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imageimport"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/network"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/pool"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vm"
	"github.com/giantswarm/vm-manager/services/hypervisor/server"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	ia := &imageArgs{}
	cmds := []cli.Command{serveCommand(), imagePushCommand(ia, stdout), imagePullCommand(ia, stdout), imageMeasureCommand(ia, stdout), imageImportCommand(ia, stdout), tpmProxyCommand()}
	args = ia.split(args, cmds)
	return cli.Main("vmm-hypervisor", "vm-manager's hypervisor (QEMU, swtpm, networks, IMDS, images)", args, stderr, cmds...)
}

func serveCommand() cli.Command {
	return cli.Command{
		Name:  "serve",
		Usage: "serve the HypervisorService on a unix socket",
		Setup: func(fs *cli.FlagSet) func(context.Context) error {
			// One line a flag: runs of them look alike; kept, as each
			// defines its own flag, variable, default and help.
			stateDir := fs.String("state-dir", "VM_MANAGER_STATE_DIR", statedir.Default(), "state directory (hypervisor.db, VM directories)")
			imageDir := fs.String("image-dir", "VM_MANAGER_IMAGE_DIR", "", "image catalog directory (default <state-dir>/images)")
			runDir := fs.String("run-dir", "VM_MANAGER_RUN_DIR", mesh.DefaultRunDir(), "runtime directory for the unix sockets")
			socket := fs.String("socket", "VM_MANAGER_HYPERVISOR_SOCKET", "", "socket to serve on (default <run-dir>/"+mesh.HypervisorSocket+")")
			verifierSock := fs.String("verifier-socket", "VM_MANAGER_VERIFIER_SOCKET", "", "attestation's VerifierService socket (default <state-dir>/"+mesh.VerifierSocket+")")
			hostConfig := hostFlags(fs)
			installTimeout := fs.Duration("install-timeout", "VM_MANAGER_INSTALL_TIMEOUT", 5*time.Minute, "how long a UKI image's installer boot may take before the VM fails")
			bootTimeout := fs.Duration("boot-timeout", "VM_MANAGER_BOOT_TIMEOUT", 4*time.Minute, "how long a boot may take to send READY=1 before the VM is marked running")
			stopTimeout := fs.Duration("stop-timeout", "VM_MANAGER_STOP_TIMEOUT", 30*time.Second, "the graceful power-down window before SIGTERM and SIGKILL")
			detach := fs.Bool("detach-vms-on-exit", "VM_MANAGER_DETACH_VMS_ON_EXIT", true, "leave VMs running when the hypervisor stops, for the next one to re-adopt; false powers them down")
			defaultNet := fs.String("default-network", "VM_MANAGER_DEFAULT_NETWORK", "default", "network created at start and used by VMs created without one (empty: none)")
			subnet := fs.String("network-subnet", "VM_MANAGER_NETWORK_SUBNET", "192.168.127.0/24", "IPv4 CIDR of the default network")
			notifyPort := fs.Int("notify-port", "VM_MANAGER_NOTIFY_PORT", 0, "AF_VSOCK port for READY=1 on hosts with /dev/vhost-vsock (0: the recorded one, else any)")
			guestSeries := fs.Int("metrics-guest-series-limit", "VM_MANAGER_METRICS_GUEST_SERIES_LIMIT", guestapi.DefaultGuestSeriesLimit, "series of one guest's systemd-report exported as vm_guest_* metrics; the rest are counted as dropped (>= 1)")
			natTCP := fs.Int("max-nat-flows-tcp", "VM_MANAGER_MAX_NAT_FLOWS_TCP", network.DefaultNATTCPPerVM, "open NAT TCP flows (host sockets) per VM; new ones over it are refused and counted (>= 1)")
			natUDP := fs.Int("max-nat-flows-udp", "VM_MANAGER_MAX_NAT_FLOWS_UDP", network.DefaultNATUDPPerVM, "open NAT UDP flows (host sockets) per VM; new ones over it are dropped and counted (>= 1)")
			natAll := fs.Int("max-nat-flows", "VM_MANAGER_MAX_NAT_FLOWS", network.DefaultNATFlows, "open NAT flows of all VMs together, at most half the descriptor limit (>= 1)")
			natUDPIdle := fs.Duration("nat-udp-idle-timeout", "VM_MANAGER_NAT_UDP_IDLE_TIMEOUT", network.DefaultNATUDPIdle, "a NAT UDP flow without a datagram either way for this long is closed")
			imdsConns := fs.Int("max-imds-connections", "VM_MANAGER_MAX_IMDS_CONNECTIONS", network.DefaultIMDSConnsPerVM, "open IMDS connections per VM; more are closed at once and counted (>= 1)")
			imdsRead := fs.Duration("imds-read-timeout", "VM_MANAGER_IMDS_READ_TIMEOUT", network.DefaultIMDSReadTimeout, "how long the IMDS waits for a whole request, body included (headers: at most 10s)")
			imdsIdle := fs.Duration("imds-idle-timeout", "VM_MANAGER_IMDS_IDLE_TIMEOUT", network.DefaultIMDSIdleTimeout, "how long the IMDS keeps an idle kept-alive connection")
			accel := fs.String("accelerator", "VM_MANAGER_ACCELERATOR", "auto", "auto (kvm where /dev/kvm is usable, else tcg) or tcg")
			maxVMs := fs.Int("max-vms", "VM_MANAGER_MAX_VMS", vm.DefaultMaxVMs, "VMs this host keeps, in any state; a create beyond is refused (resource_exhausted)")
			maxNets := fs.Int("max-networks", "VM_MANAGER_MAX_NETWORKS", vm.DefaultMaxNetworks, "networks this host keeps, the default one included")
			maxFwds := fs.Int("max-forwards-per-vm", "VM_MANAGER_MAX_FORWARDS_PER_VM", vm.DefaultMaxForwardsPerVM, "port forwards of one VM")
			maxMem := fs.Int("max-memory-mib", "VM_MANAGER_MAX_MEMORY_MIB", 0, "largest memory_mib of one VM (0: the host's MemTotal)")
			maxCPUs := fs.Int("max-cpus", "VM_MANAGER_MAX_CPUS", 0, "most cpus of one VM (0: the host's logical CPUs)")
			imdsRate := fs.Int("imds-requests-per-second", "VM_MANAGER_IMDS_REQUESTS_PER_SECOND", imds.DefaultRequestsPerSecond, "IMDS requests one VM may make per second on average; beyond, 429 with Retry-After")
			imdsBurst := fs.Int("imds-request-burst", "VM_MANAGER_IMDS_REQUEST_BURST", imds.DefaultBurst, "IMDS requests one VM may make at once before the rate applies")
			maxQuote := fs.Int("imds-max-quote-bytes", "VM_MANAGER_IMDS_MAX_QUOTE_BYTES", imds.DefaultMaxQuoteBytes, "largest body of POST attest/quote; beyond, 413")
			maxReport := fs.Int("imds-max-report-bytes", "VM_MANAGER_IMDS_MAX_REPORT_BYTES", imds.DefaultMaxReportBytes, "largest body of POST report; beyond, 413")
			maxImage := fs.Int("max-image-bytes", "VM_MANAGER_MAX_IMAGE_BYTES", imageimport.DefaultMaxImageBytes, "largest OCI image an import takes: its compressed layers, and its root's file contents (resource_exhausted beyond, counted)")
			storeQuota := fs.Int("image-store-bytes", "VM_MANAGER_IMAGE_STORE_BYTES", imageimport.DefaultStoreQuota, "the roots of all imported OCI images together; an import beyond is refused (resource_exhausted, counted)")
			ociBoot := fs.String("oci-boot-image", "VM_MANAGER_OCI_BOOT_IMAGE", imageimport.DefaultBootImage, "the kernel image (vmlinuz, initrd, cmdline) that boots imported OCI images, unless an import names another")
			plainRegistry := fs.Bool("registry-plain-http", "VM_MANAGER_REGISTRY_PLAIN_HTTP", false, "talk HTTP, not HTTPS, to every registry an import reads (loopback registries always are)")
			maxPools := fs.Int("max-pools", "VM_MANAGER_MAX_POOLS", pool.DefaultMaxPools, "warm pools on this host; one more is refused (resource_exhausted)")
			maxPoolSize := fs.Int("max-pool-size", "VM_MANAGER_MAX_POOL_SIZE", pool.DefaultMaxSize, "largest size of one warm pool")
			poolDisk := fs.Int("pool-disk-bytes", "VM_MANAGER_POOL_DISK_BYTES", pool.DefaultDiskBytes, "what all warm pools' members may hold on disk together (saved RAM, disk, vTPM); a refill beyond is refused and counted")
			poolRefills := fs.Int("pool-refill-concurrency", "VM_MANAGER_POOL_REFILL_CONCURRENCY", 1, "warm-pool members booting at once (the CPU budget of refills)")
			consoleMax := fs.Int("console-log-max-bytes", "VM_MANAGER_CONSOLE_LOG_MAX_BYTES", vm.DefaultConsoleLogMaxBytes, "serial console kept per VM, console.log and console.log.1 together (at least 64 KiB)")
			defaultTTL := fs.Duration("default-vm-ttl", "VM_MANAGER_DEFAULT_VM_TTL", 0, "expiry of a VM created without ttl or expire_at (0: none, it lives until deleted)")
			maxTTL := fs.Duration("max-vm-ttl", "VM_MANAGER_MAX_VM_TTL", vm.DefaultMaxTTL, "longest ttl, expire_at and idle_timeout a caller may set")
			maxWatchers := fs.Int("max-watchers", "VM_MANAGER_MAX_WATCHERS", vm.DefaultMaxWatchers, "open WatchVirtualMachines streams; one more is refused (resource_exhausted) and counted")
			watchBuffer := fs.Int("watch-buffer", "VM_MANAGER_WATCH_BUFFER", vm.DefaultWatchBuffer, "events one watch stream may fall behind before it is cut off (resource_exhausted, counted; the client resumes)")
			watchRetain := fs.Int("watch-retain", "VM_MANAGER_WATCH_RETAIN", vm.DefaultWatchRetain, "events kept for watch resumes (since_revision); an older revision is refused with out_of_range")
			maxExec := fs.Int("max-exec-sessions", "VM_MANAGER_MAX_EXEC_SESSIONS", execstream.DefaultMaxSessions, "streamed exec sessions open on this host at once; more are refused (resource_exhausted) and counted")
			execIdle := fs.Duration("exec-idle-timeout", "VM_MANAGER_EXEC_IDLE_TIMEOUT", execstream.DefaultIdleTimeout, "a streamed exec session without input or output for this long is ended")
			execMax := fs.Duration("exec-max-duration", "VM_MANAGER_EXEC_MAX_DURATION", execstream.DefaultMaxDuration, "the longest a streamed exec session may run")
			nodeIndex := fs.Int("node-index", "VM_MANAGER_NODE_INDEX", -1, "this node's index in a fleet, 0..4095: VM ids start with it as 3 hex characters, so the fleet gateway routes by id (-1: no fleet, fully random ids)")
			nodeName := fs.String("node-name", "VM_MANAGER_NODE_NAME", "", "this node's name in a fleet, reported in the host report")
			nodeLabels := fs.String("node-labels", "VM_MANAGER_NODE_LABELS", "", "this node's labels in a fleet, k=v,...: reported in the host report, matched by a create's node_selector")
			oidc := identity.Flags(fs)
			serve := observe.Flags(fs, "info", "hypervisor", tracing.Hypervisor, false)
			return serve(func(ctx context.Context, log *slog.Logger) error {
				if *notifyPort < 0 || *notifyPort > 1<<32-1 {
					return fmt.Errorf("--notify-port=%d: want 0..4294967295", *notifyPort)
				}
				if *guestSeries < 1 {
					return fmt.Errorf("--metrics-guest-series-limit=%d: want at least 1", *guestSeries)
				}
				if *accel != "auto" && *accel != "tcg" {
					return fmt.Errorf("--accelerator=%q: want auto or tcg", *accel)
				}
				for _, f := range []struct {
					name string
					v    int
					min  int
				}{
					{"max-vms", *maxVMs, 1}, {"max-networks", *maxNets, 1}, {"max-forwards-per-vm", *maxFwds, 1},
					{"max-memory-mib", *maxMem, 0}, {"max-cpus", *maxCPUs, 0},
					{"imds-requests-per-second", *imdsRate, 1}, {"imds-request-burst", *imdsBurst, 1},
					{"imds-max-quote-bytes", *maxQuote, 1}, {"imds-max-report-bytes", *maxReport, 1},
					{"console-log-max-bytes", *consoleMax, vm.MinConsoleLogMaxBytes},
					{"max-image-bytes", *maxImage, 1 << 20}, {"image-store-bytes", *storeQuota, 1 << 20},
					{"max-nat-flows-tcp", *natTCP, 1}, {"max-nat-flows-udp", *natUDP, 1}, {"max-nat-flows", *natAll, 1},
					{"max-imds-connections", *imdsConns, 1}, {"max-exec-sessions", *maxExec, 1},
					{"max-watchers", *maxWatchers, 1}, {"watch-buffer", *watchBuffer, 1}, {"watch-retain", *watchRetain, 1},
					{"max-pools", *maxPools, 1}, {"max-pool-size", *maxPoolSize, 1}, {"pool-disk-bytes", *poolDisk, 1 << 20},
					{"pool-refill-concurrency", *poolRefills, 1},
				} {
					if f.v < f.min {
						return fmt.Errorf("--%s=%d: want at least %d", f.name, f.v, f.min)
					}
				}
				if *maxMem > math.MaxInt32 || *maxCPUs > math.MaxInt32 {
					return fmt.Errorf("--max-memory-mib and --max-cpus: want at most %d", math.MaxInt32)
				}
				for _, f := range []struct {
					name string
					v    time.Duration
				}{{"nat-udp-idle-timeout", *natUDPIdle}, {"imds-read-timeout", *imdsRead}, {"imds-idle-timeout", *imdsIdle},
					{"exec-idle-timeout", *execIdle}, {"exec-max-duration", *execMax}} {
					if f.v < time.Second {
						return fmt.Errorf("--%s=%s: want at least 1s", f.name, f.v)
					}
				}
				if *maxTTL < time.Second || *defaultTTL < 0 || *defaultTTL > *maxTTL {
					return fmt.Errorf("--max-vm-ttl=%s, --default-vm-ttl=%s: want max at least 1s and default within 0..max", *maxTTL, *defaultTTL)
				}
				node, err := fleetNode(*nodeIndex, *nodeName, *nodeLabels)
				if err != nil {
					return err
				}
				hostCfg := hostConfig()
				hostCfg.ForceTCG, hostCfg.Node = *accel == "tcg", node
				self, err := os.Executable() // its tpm-proxy command serves forks
				if err != nil {
					return fmt.Errorf("own executable: %w", err)
				}
				return server.Run(ctx, server.Config{
					StateDir:         *stateDir,
					ImageDir:         *imageDir,
					Socket:           cmp.Or(*socket, filepath.Join(*runDir, mesh.HypervisorSocket)),
					VerifierSocket:   cmp.Or(*verifierSock, filepath.Join(*stateDir, mesh.VerifierSocket)),
					InstallTimeout:   *installTimeout,
					BootTimeout:      *bootTimeout,
					StopTimeout:      *stopTimeout,
					StopVMsOnExit:    !*detach,
					NotifyPort:       uint32(*notifyPort),
					DefaultNetwork:   *defaultNet,
					DefaultSubnet:    *subnet,
					GuestSeriesLimit: *guestSeries,
					Limits: vm.Limits{MaxVMs: *maxVMs, MaxNetworks: *maxNets, MaxForwardsPerVM: *maxFwds,
						MaxMemoryMiB: int32(*maxMem), MaxCPUs: int32(*maxCPUs)},
					IMDS: imds.Limits{RequestsPerSecond: float64(*imdsRate), Burst: *imdsBurst,
						MaxQuoteBytes: int64(*maxQuote), MaxReportBytes: int64(*maxReport)},
					ConsoleLogMaxBytes: int64(*consoleMax),
					MaxNATFlowsTCP:     *natTCP,
					MaxNATFlowsUDP:     *natUDP,
					MaxNATFlows:        *natAll,
					NATUDPIdleTimeout:  *natUDPIdle,
					MaxIMDSConnections: *imdsConns,
					IMDSReadTimeout:    *imdsRead,
					IMDSIdleTimeout:    *imdsIdle,
					Host:               hostCfg,
					Identity:           oidc(),
					Lifetimes:          vm.Lifetimes{DefaultTTL: *defaultTTL, MaxTTL: *maxTTL},
					Watch:              vm.WatchLimits{MaxWatchers: *maxWatchers, Buffer: *watchBuffer, Retain: *watchRetain},
					Exec:               execstream.Config{MaxSessions: *maxExec, IdleTimeout: *execIdle, MaxDuration: *execMax},
					Import: imageimport.Config{MaxImageBytes: int64(*maxImage), StoreQuota: int64(*storeQuota),
						BootImage: *ociBoot, PlainHTTP: *plainRegistry},
					Pools:          pool.Config{MaxPools: *maxPools, MaxSize: *maxPoolSize, DiskBytes: int64(*poolDisk), Concurrency: *poolRefills},
					TPMProxyBinary: self,
				}, log)
			})
		},
	}
}

// fleetNode checks the fleet flags: an index within what a VM id's 3 hex
// characters hold, or -1 for none.
func fleetNode(index int, name, labelList string) (host.Node, error) {
	if index < -1 || index > 0xfff {
		return host.Node{}, fmt.Errorf("--node-index=%d: want -1 (no fleet) or 0..4095", index)
	}
	l, err := labels.Parse(labelList)
	if err != nil {
		return host.Node{}, fmt.Errorf("--node-labels: %w", err)
	}
	n := host.Node{Name: name, Labels: l}
	if index >= 0 {
		i := int32(index)
		n.Index = &i
	}
	return n, nil
}
