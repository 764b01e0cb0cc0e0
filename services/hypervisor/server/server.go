// Package server runs the hypervisor process: its state directory (locked),
// its bbolt database, the image catalog, the host report, and the gRPC
// HypervisorService on a unix socket.
package server

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/backend"
	"github.com/giantswarm/vm-manager/pkg/identity"
	"github.com/giantswarm/vm-manager/pkg/mesh"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/apiserver"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/catalog"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/driver"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/execstream"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/guestapi"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/host"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imageimport"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/network"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/notify"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/policysync"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/pool"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/qemu"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/swtpm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vm"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore"
	"golang.org/x/sys/unix"
)

// Config is what the hypervisor needs.
type Config struct {
	// StateDir holds hypervisor.db, hypervisor.lock and the VM directories.
	StateDir string
	// ImageDir is the image catalog; default <StateDir>/images.
	ImageDir string
	// Socket is the unix socket to serve on.
	Socket string
	// VerifierSocket is attestation's VerifierService (nonces, quotes, boots,
	// keys, policies), which only the hypervisor reaches.
	VerifierSocket string
	// Host probing settings (binaries, OVMF files).
	Host host.Config
	// VM lifecycle timeouts and exit behaviour (zero values take the defaults).
	InstallTimeout time.Duration
	BootTimeout    time.Duration
	StopTimeout    time.Duration
	// DefaultNetwork is created at start from DefaultSubnet when missing and
	// used by VMs created without a network.
	DefaultNetwork string
	DefaultSubnet  string
	// NotifyPort is the AF_VSOCK readiness port on hosts with /dev/vhost-vsock;
	// 0 reuses the port recorded in <state>/notify-port, else the kernel picks.
	NotifyPort uint32
	// StopVMsOnExit powers VMs down on exit instead of leaving them for the
	// next hypervisor (--detach-vms-on-exit=false).
	StopVMsOnExit bool
	// GuestSeriesLimit bounds the exported series of one guest's report
	// (--metrics-guest-series-limit).
	GuestSeriesLimit int
	// Limits are the per-host and per-VM bounds; MaxMemoryMiB and MaxCPUs 0
	// take the host's MemTotal and logical CPUs, the others' zero values
	// their defaults.
	Limits vm.Limits
	// Watch bounds the watch streams.
	Watch vm.WatchLimits
	// IMDS are the IMDS's per-VM bounds (zero values: the defaults).
	IMDS imds.Limits
	// ConsoleLogMaxBytes bounds each VM's serial console files
	// (vm.DefaultConsoleLogMaxBytes when 0).
	ConsoleLogMaxBytes int64
	// Lifetimes are the default and bound of VM expiries (--default-vm-ttl,
	// --max-vm-ttl).
	Lifetimes vm.Lifetimes
	// What one VM can make its network hold on the host, and the IMDS's
	// patience (--max-nat-flows-tcp, --max-nat-flows-udp,
	// --nat-udp-idle-timeout, --max-imds-connections, --imds-read-timeout,
	// --imds-idle-timeout); MaxNATFlows bounds all networks' NAT flows
	// together (--max-nat-flows), at most half the descriptor limit. Zero
	// values take the defaults.
	MaxNATFlowsTCP, MaxNATFlowsUDP, MaxNATFlows int
	NATUDPIdleTimeout                           time.Duration
	MaxIMDSConnections                          int
	IMDSReadTimeout, IMDSIdleTimeout            time.Duration
	// Identity, with an issuer, requires every HypervisorService call to carry
	// a valid token (the gateway forwards the caller's) and records the caller
	// on the VMs and networks it creates. Health and reflection stay open.
	Identity identity.Config
	// Exec bounds the streamed exec sessions (--max-exec-sessions,
	// --exec-idle-timeout, --exec-max-duration; zero values: the defaults).
	Exec execstream.Config
	// Import bounds and places OCI image imports (--max-image-bytes,
	// --image-store-bytes, --oci-boot-image, --registry-plain-http).
	Import imageimport.Config
	// Pools bound the warm pools (--max-pools, --max-pool-size,
	// --pool-disk-bytes, --pool-refill-concurrency).
	Pools pool.Config
	// TPMProxyBinary is the executable whose "tpm-proxy" command relays a
	// fork's vTPM control channel (the hypervisor's own); empty relays it
	// in this process (services run in one test process).
	TPMProxyBinary string
}

// networkLimits turns the configuration into the networks' limits, keeping
// the host's NAT flows below half the process's descriptor limit.
func networkLimits(cfg Config, log *slog.Logger) network.Limits {
	flows := cfg.MaxNATFlows
	if flows <= 0 {
		flows = network.DefaultNATFlows
	}
	var rl unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &rl); err == nil && rl.Cur != unix.RLIM_INFINITY && uint64(flows) > rl.Cur/2 {
		log.Warn("NAT flow bound lowered to half the descriptor limit", "max_nat_flows", flows, "nofile", rl.Cur, "now", rl.Cur/2)
		flows = int(rl.Cur / 2)
	}
	return network.Limits{
		NATTCPPerVM:     cfg.MaxNATFlowsTCP,
		NATUDPPerVM:     cfg.MaxNATFlowsUDP,
		NATUDPIdle:      cfg.NATUDPIdleTimeout,
		Host:            network.NewFlowBudget(flows),
		IMDSConnsPerVM:  cfg.MaxIMDSConnections,
		IMDSReadTimeout: cfg.IMDSReadTimeout,
		IMDSIdleTimeout: cfg.IMDSIdleTimeout,
	}
}

// Run serves until ctx ends.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	if cfg.ImageDir == "" {
		cfg.ImageDir = filepath.Join(cfg.StateDir, "images")
	}
	b, err := backend.Open(ctx, "hypervisor", cfg.StateDir, cfg.Identity, log)
	if err != nil {
		return err
	}
	defer b.Close()
	verifier := b.Verifier

	st, err := vmstore.Open(filepath.Join(cfg.StateDir, "hypervisor.db"))
	if err != nil {
		return err
	}
	defer st.Close()

	cat, err := catalog.Load(cfg.ImageDir, log)
	if err != nil {
		return fmt.Errorf("image catalog: %w", err)
	}
	log.Info("image catalog loaded", "dir", cfg.ImageDir, "images", len(cat.List()))

	hostname, _ := os.Hostname()
	// The CA that vouches for every vTPM this host provisions (EK certificates).
	ca, err := swtpm.LoadCA(filepath.Join(cfg.StateDir, "vtpm-ca"), "vm-manager vTPM CA "+hostname)
	if err != nil {
		return err
	}
	cfg.Host.VTPMCACertificate = string(ca.CertificatePEM())

	// /dev/kvm opening is not proof that KVM runs guests: probe once, and the
	// host report and every VM use TCG when it does not.
	report := host.New(cfg.Host).Report(ctx)
	cpu := ""
	if report.GetAccelerator() == hypervisorv1.Accelerator_ACCELERATOR_KVM && report.GetOvmfCode() != "" {
		var cached bool
		cpu, cached, cfg.Host.KVMUnusable = qemu.ProbeKVMCached(ctx, filepath.Join(cfg.StateDir, "kvm-probe.json"), report.GetQemu().GetPath(), report.GetOvmfCode(), report.GetOvmfVars())
		log.Info("KVM probe", "cpu", cpu, "unusable", cfg.Host.KVMUnusable, "cached", cached)
		if cpu != "" && cpu != qemu.CPUHost {
			log.Warn("KVM rejects -cpu host on this host (nested virtualisation); using "+cpu, "cpu", cpu)
		}
	}
	prober := host.New(cfg.Host)
	report = prober.Report(ctx)
	log.Info("host", "accelerator", report.GetAccelerator().String(), "ready", report.GetReady(), "missing", report.GetMissing())
	for _, w := range report.GetWarnings() {
		log.Warn(w)
	}

	aconn, err := mesh.DialBackend(cfg.VerifierSocket, "attestation")
	if err != nil {
		return fmt.Errorf("verifier socket: %w", err)
	}
	defer aconn.Close()

	qemuBin := cfg.Host.QEMUBinary
	if qemuBin == "" {
		qemuBin = host.DefaultQEMUBinary
	}
	version, err := qemu.ProbeVersion(ctx, qemuBin)
	if err != nil {
		log.Warn("qemu version unknown; VMs cannot start until QEMU is installed", "error", err)
	}
	router := notify.NewRouter()
	var vsockPort uint32
	if report.GetVhostVsock().GetAccessible() {
		l, port, err := listenNotify(cfg.StateDir, cfg.NotifyPort)
		if err != nil {
			return err
		}
		vsockPort = port
		go func() {
			if err := router.ServeVsock(ctx, l); err != nil {
				log.Error("vsock readiness listener stopped", "error", err)
			}
		}()
		log.Info("readiness over AF_VSOCK", "port", port)
	}
	limits := cfg.Limits
	if limits.MaxMemoryMiB == 0 {
		limits.MaxMemoryMiB = int32(min(report.GetMemoryBytes()>>20, math.MaxInt32)) // 0 when unknown: no bound
	}
	if limits.MaxCPUs == 0 {
		limits.MaxCPUs = report.GetCpus()
	}
	drv := driver.New(driver.Config{
		StateDir:        cfg.StateDir,
		QEMUBinary:      qemuBin,
		QEMUImgBinary:   cfg.Host.QEMUImgBinary,
		SwtpmBinary:     cfg.Host.SwtpmBinary,
		OVMFCode:        report.GetOvmfCode(),
		OVMFVars:        report.GetOvmfVars(),
		Accelerator:     report.GetAccelerator(),
		QEMUVersion:     version,
		CPU:             cpu,
		NotifyVsockPort: vsockPort,
		VTPMCA:          ca,
		TPMProxyBinary:  cfg.TPMProxyBinary,
	}, log)
	vms, err := wireVMs(vm.Config{
		StateDir:           cfg.StateDir,
		ImageDir:           cfg.ImageDir,
		Accelerator:        report.GetAccelerator(),
		Region:             hostname,
		Firmware:           report.GetFirmware(),
		DefaultNetwork:     cfg.DefaultNetwork,
		DefaultSubnet:      cfg.DefaultSubnet,
		InstallTimeout:     cfg.InstallTimeout,
		BootTimeout:        cfg.BootTimeout,
		StopTimeout:        cfg.StopTimeout,
		StopVMsOnExit:      cfg.StopVMsOnExit,
		GuestSeriesLimit:   cfg.GuestSeriesLimit,
		Limits:             limits,
		IMDS:               cfg.IMDS,
		ConsoleLogMaxBytes: cfg.ConsoleLogMaxBytes,
		Lifetimes:          cfg.Lifetimes,
		Network:            networkLimits(cfg, log),
		Watch:              cfg.Watch,
		IDPrefix:           idPrefix(cfg.Host.Node),
	}, cfg.Pools, log, st, cat, attestationv1.NewVerifierServiceClient(aconn), router, drv)
	if err != nil {
		return err
	}
	defer vms.close()
	vms.run()
	// Watch streams never end by themselves: end them when the drain starts.
	stopWatches := context.AfterFunc(ctx, vms.endWatches)
	defer stopWatches()

	// The internal TelemetryService is read-only and needs no token: the
	// gateway's metrics scrape has no caller (see its proto).
	srv := mesh.NewServer(log, verifier.ServerOptions(hypervisorv1.TelemetryService_ServiceDesc.ServiceName)...)
	if removed := imageimport.Sweep(cfg.ImageDir); len(removed) > 0 {
		log.Warn("removed what unfinished image imports left", "files", removed)
		_ = cat.Refresh()
	}
	importCfg := cfg.Import
	importCfg.Firmware = report.GetFirmware()
	importer := imageimport.New(importCfg, cat, drv, policysync.Syncer{Store: st, Client: attestationv1.NewVerifierServiceClient(aconn)}, log.With("component", "import"))
	deps := vms.api(prober, cat)
	deps.Importer = importer
	api := apiserver.New(deps).
		WithExecStreams(execstream.New(ctx, cfg.Exec, vms.access, log.With("component", "exec")))
	hypervisorv1.RegisterHypervisorServiceServer(srv, api)
	hypervisorv1.RegisterTelemetryServiceServer(srv, api.Telemetry())
	ln, err := mesh.Listen(cfg.Socket)
	if err != nil {
		return err
	}
	srv.SetServing()
	log.Info("hypervisor serving", "socket", cfg.Socket, "state", cfg.StateDir, "oidc_issuer", verifier.Issuer())

	go policysync.Run(ctx, log, cat, st, attestationv1.NewVerifierServiceClient(aconn))

	if err := srv.ServeUntil(ctx, ln); err != nil {
		return err
	}
	log.Info("hypervisor stopped")
	return nil
}

// The guest side is what each network's IMDS serves guests from (mounted in
// the userspace network stack).
var _ imds.VMs = (*guestapi.NetworkView)(nil)

// listenNotify binds the vsock readiness port: the one asked for, else the
// one recorded by an earlier run (guests booted then were told it), else a
// new one, which is recorded.
func listenNotify(stateDir string, port uint32) (notify.Listener, uint32, error) {
	record := filepath.Join(stateDir, "notify-port")
	if port == 0 {
		if b, err := os.ReadFile(record); err == nil {
			if n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 32); err == nil {
				port = uint32(n)
			}
		}
	}
	l, bound, err := notify.ListenVsock(port)
	if err != nil {
		return nil, 0, err
	}
	if err := os.WriteFile(record, []byte(strconv.FormatUint(uint64(bound), 10)+"\n"), 0o600); err != nil {
		l.Close()
		return nil, 0, err
	}
	return l, bound, nil
}

// idPrefix is a fleet node's VM id prefix: its index as 3 hex characters
// (fleet.IndexOf reads it back), or none outside a fleet.
func idPrefix(n host.Node) string {
	if n.Index == nil {
		return ""
	}
	return fmt.Sprintf("%03x", *n.Index)
}
