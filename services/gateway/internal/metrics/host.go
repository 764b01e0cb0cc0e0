package metrics

import (
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/gate"
	"github.com/giantswarm/vm-manager/sdk/enumname"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"
)

const (
	backendHypervisor = "hypervisor"
	// metricsParallel bounds the concurrent GetVirtualMachineMetrics calls of a scrape.
	metricsParallel = 8
)

// Histogram buckets (contract §10).
var (
	installBuckets     = []float64{10, 20, 30, 45, 60, 90, 120, 180, 300}
	bootToReadyBuckets = []float64{1, 2, 5, 10, 15, 20, 30, 60, 120}
)

// stateNames are the contract's lowercase VM states, in enum order.
var stateNames = enumname.Names(hypervisorv1.State(0).Descriptor())

// attestationNames are disabled, pending, released and failed.
var attestationNames = enumname.Names(hypervisorv1.AttestationState(0).Descriptor())

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(name, help, labels, nil)
}

var (
	descVMState       = desc("vm_manager_vm_state", "1 for the VM's current state, 0 for the others.", "vm", "name", "state")
	descVMAttestation = desc("vm_manager_vm_attestation", "1 for the VM's attestation state (disabled, pending, released, failed), 0 for the others.", "vm", "name", "state")
	descVMInfo        = desc("vm_manager_vm_info", "Always 1; the labels describe the VM.", "vm", "name", "network", "ip", "image")
	descVMCreated     = desc("vm_manager_vm_created_timestamp_seconds", "When the VM was created, in seconds since the epoch.", "vm", "name")
	descVMInstall     = desc("vm_manager_vm_install_seconds", "Seconds from creation until the installer finished.", "vm", "name")
	descVMBootToReady = desc("vm_manager_vm_boot_to_ready_seconds", "Seconds from the installed boot's start until READY=1, of the last boot that got there.", "vm", "name")
	descVMCPU         = desc("vm_manager_vm_cpu_seconds_total", "CPU time of the VM's QEMU process.", "vm", "name")
	descVMRSS         = desc("vm_manager_vm_memory_rss_bytes", "Resident memory of the VM's QEMU process.", "vm", "name")
	descVMDisk        = desc("vm_manager_vm_disk_bytes", "Space the VM's files take on the host.", "vm", "name")
	descVMs           = desc("vm_manager_vms", "VMs per state.", "state")
	descNetBytes      = desc("vm_manager_network_bytes_total", "Bytes through a network's switch: sent to VMs, received from VMs.", "network", "direction")
	descNetLeases     = desc("vm_manager_network_leases", "Addresses held on a network.", "network")
	descNetDropped    = desc("vm_manager_network_dropped_frames_total", "Frames a VM sent with another MAC or IP than its lease's, dropped before they reached the network.", "network", "vm")
	descBackendUp     = desc("vm_manager_backend_up", "1 if the backend answered the last scrape, else 0.", "backend")

	descEgressDropped = desc("vm_manager_network_egress_dropped_total", "Packets a VM sent that its network's egress policy dropped: not allowed by the rules or the default (rule), or to an address of the network it does not serve (local).", "network", "vm", "reason")
	descNATFlows      = desc("vm_manager_network_nat_flows", "NAT flows (host sockets) open for a VM.", "network", "vm", "protocol")
	descNATRefused    = desc("vm_manager_network_nat_refused_total", "New NAT flows of a VM refused: over its bound (tcp_vm_limit, udp_vm_limit) or the host's (tcp_host_limit, udp_host_limit).", "network", "vm", "reason")
	descDNSRefused    = desc("vm_manager_network_dns_refused_total", "DNS lookups of a VM its network refused: by its DNS policy (policy), too many at once (busy), too many pinned addresses (pins).", "network", "vm", "reason")
	descIMDSConns     = desc("vm_manager_network_imds_connections", "Open IMDS connections of a VM.", "network", "vm")
	descIMDSDropped   = desc("vm_manager_network_imds_connections_dropped_total", "IMDS connections of a VM closed at once over its bound (limit) or because a request did not arrive in time (timeout).", "network", "vm", "reason")
)

// hostCollector asks the hypervisor at scrape time.
type hostCollector struct {
	hv      Source
	log     *slog.Logger
	timeout time.Duration

	install      prometheus.Histogram
	bootToReady  prometheus.Histogram
	bootPhases   *prometheus.HistogramVec
	scrapeErrors *prometheus.CounterVec

	// mu serialises scrapes and guards observed and wasUp.
	mu sync.Mutex
	// observed holds, per VM still listed, the keys whose durations the
	// histograms already have; so it is bounded by the number of VMs.
	observed map[string]observedKeys
	wasUp    *bool
}

type observedKeys struct{ install, bootToReady, bootPhases string }

func newHostCollector(hv Source, log *slog.Logger, timeout time.Duration) *hostCollector {
	return &hostCollector{
		hv:      hv,
		log:     log,
		timeout: timeout,
		install: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "vm_manager_vm_install_duration_seconds",
			Help:    "Install durations, each VM's once.",
			Buckets: installBuckets,
		}),
		bootToReady: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "vm_manager_vm_boot_to_ready_duration_seconds",
			Help:    "Boot-to-ready durations, each boot's once.",
			Buckets: bootToReadyBuckets,
		}),
		bootPhases: newBootPhaseHistogram(),
		scrapeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "vm_manager_scrape_errors_total",
			Help: "Backend calls that failed while collecting metrics.",
		}, []string{"backend"}),
		observed: map[string]observedKeys{},
	}
}

func (c *hostCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{
		descVMState, descVMAttestation, descVMInfo, descVMCreated, descVMInstall, descVMBootToReady,
		descVMCPU, descVMRSS, descVMDisk, descVMs, descNetBytes, descNetLeases, descNetDropped,
		descBackendUp, descEgressDropped, descNATFlows, descNATRefused, descDNSRefused, descIMDSConns, descIMDSDropped,
		descVMBootPhase,
	} {
		ch <- d
	}
	for _, d := range lifetimeDescs {
		ch <- d
	}
	c.install.Describe(ch)
	c.bootToReady.Describe(ch)
	c.bootPhases.Describe(ch)
	c.scrapeErrors.Describe(ch)
}

// snapshot is what one scrape got from the hypervisor.
type snapshot struct {
	vms      []*hypervisorv1.VirtualMachine
	vmsErr   error
	networks []*hypervisorv1.Network
	netErr   error
	// metrics per VM id; absent when the call failed.
	metrics map[string]*hypervisorv1.VirtualMachineMetrics
	// errors counts the failed calls.
	errors int
}

func (c *hostCollector) fetch() *snapshot {
	s := &snapshot{metrics: map[string]*hypervisorv1.VirtualMachineMetrics{}}
	if c.hv == nil {
		s.vmsErr = status.Error(codes.Unavailable, "no hypervisor client")
		s.netErr = s.vmsErr
		return s
	}
	ctx, cancel := scrapeContext(c.timeout)
	defer cancel()

	var wg sync.WaitGroup
	wg.Go(func() {
		r, err := c.hv.ListNetworks(ctx, &hypervisorv1.ListNetworksRequest{})
		s.networks, s.netErr = r.GetNetworks(), err
	})
	r, err := c.hv.ListVirtualMachines(ctx, &hypervisorv1.ListVirtualMachinesRequest{})
	s.vms, s.vmsErr = onePerID(r.GetVms(), (*hypervisorv1.VirtualMachine).GetId), err
	if err == nil {
		var mu sync.Mutex
		sem := make(chan struct{}, metricsParallel)
		for _, vm := range s.vms {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				m, err := c.hv.GetVirtualMachineMetrics(ctx, &hypervisorv1.GetVirtualMachineMetricsRequest{Id: vm.GetId()})
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil:
					s.metrics[vm.GetId()] = m
				case status.Code(err) == codes.NotFound:
					// Deleted since the list: not a failure.
				default:
					s.errors++
					c.log.Debug("metrics: vm metrics", "vm", vm.GetId(), "error", err)
				}
			})
		}
	}
	wg.Wait()
	if s.vmsErr != nil {
		s.errors++
	}
	if s.netErr != nil {
		s.errors++
	}
	return s
}

func (c *hostCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.fetch()
	if s.errors > 0 {
		c.scrapeErrors.WithLabelValues(backendHypervisor).Add(float64(s.errors))
	} else {
		c.scrapeErrors.WithLabelValues(backendHypervisor) // exposed as 0 from the start
	}
	up := s.vmsErr == nil
	c.logTransition(up, s.vmsErr)
	ch <- gauge(descBackendUp, b2f(up), backendHypervisor)

	if up {
		c.collectVMs(ch, s)
	}
	c.collectNetworks(ch, s)

	c.install.Collect(ch)
	c.bootToReady.Collect(ch)
	c.bootPhases.Collect(ch)
	c.scrapeErrors.Collect(ch)
}

func (c *hostCollector) logTransition(up bool, err error) {
	switch {
	case c.wasUp == nil && !up, c.wasUp != nil && *c.wasUp && !up:
		c.log.Warn("metrics: hypervisor unavailable; exposing what is possible", "error", err)
	case c.wasUp != nil && !*c.wasUp && up:
		c.log.Info("metrics: hypervisor answers again")
	}
	c.wasUp = &up
}

func (c *hostCollector) collectVMs(ch chan<- prometheus.Metric, s *snapshot) {
	perState := make(map[string]int, len(stateNames))
	listed := make(map[string]bool, len(s.vms))
	for _, vm := range s.vms {
		id, name := vm.GetId(), vm.GetName()
		listed[id] = true
		m := s.metrics[id]
		h := m.GetHost()

		state := enumname.Of(vm.GetState())
		perState[state]++
		for _, st := range stateNames {
			ch <- gauge(descVMState, b2f(st == state), id, name, st)
		}
		att := attestationFromRecord(vm)
		if h != nil && h.GetAttestation() != hypervisorv1.AttestationState_ATTESTATION_STATE_UNSPECIFIED {
			att = h.GetAttestation()
		}
		attName := enumname.Of(att)
		for _, st := range attestationNames {
			ch <- gauge(descVMAttestation, b2f(st == attName), id, name, st)
		}
		ch <- gauge(descVMInfo, 1, id, name, vm.GetNetwork(), vm.GetIp(), vm.GetImage())
		if ts := vm.GetCreatedAt(); ts != nil {
			ch <- gauge(descVMCreated, seconds(ts), id, name)
		}
		collectLifetime(ch, vm, time.Now())
		if h == nil {
			continue
		}
		if h.InstallSeconds != nil {
			ch <- gauge(descVMInstall, h.GetInstallSeconds(), id, name)
		}
		if h.BootToReadySeconds != nil {
			ch <- gauge(descVMBootToReady, h.GetBootToReadySeconds(), id, name)
		}
		collectBootPhases(ch, h, id, name)
		if h.CpuSeconds != nil {
			ch <- counter(descVMCPU, h.GetCpuSeconds(), id, name)
		}
		if h.MemoryRssBytes != nil {
			ch <- gauge(descVMRSS, float64(h.GetMemoryRssBytes()), id, name)
		}
		ch <- gauge(descVMDisk, float64(h.GetDiskBytes()), id, name)
		if n := h.GetNetwork(); n.GetName() != "" {
			collectNetwork(ch, n, id)
		}
		c.observeDurations(vm, h)
	}
	for _, st := range stateNames {
		ch <- gauge(descVMs, float64(perState[st]), st)
	}
	for id := range c.observed {
		if !listed[id] {
			delete(c.observed, id)
		}
	}
}

// observeDurations puts a VM's install and boot-to-ready durations into the
// histograms the first time they are seen; a new boot (another booted/ready
// time) counts again.
func (c *hostCollector) observeDurations(vm *hypervisorv1.VirtualMachine, h *hypervisorv1.HostMetrics) {
	id := vm.GetId()
	keys := c.observed[id]
	if h.InstallSeconds != nil && h.GetInstallSeconds() >= 0 {
		k := tsKey(vm.GetInstalledAt())
		if k == "" {
			k = "set"
		}
		if keys.install != k {
			c.install.Observe(h.GetInstallSeconds())
			keys.install = k
		}
	}
	if h.BootToReadySeconds != nil && h.GetBootToReadySeconds() >= 0 {
		k := tsKey(vm.GetBootedAt()) + "/" + tsKey(vm.GetReadyAt())
		if k == "/" {
			k = "set"
		}
		if keys.bootToReady != k {
			c.bootToReady.Observe(h.GetBootToReadySeconds())
			keys.bootToReady = k
		}
	}
	if h.GetBootPhases() != nil {
		c.observeBootPhases(h, tsKey(vm.GetBootedAt())+"/"+tsKey(vm.GetReadyAt()), &keys)
	}
	if keys != (observedKeys{}) {
		c.observed[id] = keys
	}
}

// collectNetworks emits the per-network families: leases from ListNetworks
// (else from the VMs' metrics), bytes from the VMs' metrics, which report
// their network's switch counters.
func (c *hostCollector) collectNetworks(ch chan<- prometheus.Metric, s *snapshot) {
	type netStats struct {
		sent, received int64
		leases         int32
		hasBytes       bool
		hasLeases      bool
	}
	nets := map[string]*netStats{}
	var order []string
	get := func(name string) *netStats {
		n := nets[name]
		if n == nil {
			n = &netStats{}
			nets[name] = n
			order = append(order, name)
		}
		return n
	}
	if s.netErr == nil {
		for _, n := range s.networks {
			if name := n.GetSpec().GetName(); name != "" {
				st := get(name)
				st.leases, st.hasLeases = int32(len(n.GetLeases())), true
			}
		}
	}
	for _, vm := range s.vms {
		nm := s.metrics[vm.GetId()].GetHost().GetNetwork()
		if nm.GetName() == "" {
			continue
		}
		st := get(nm.GetName())
		st.sent = max(st.sent, nm.GetBytesSent())
		st.received = max(st.received, nm.GetBytesReceived())
		st.hasBytes = true
		if s.netErr != nil {
			st.leases, st.hasLeases = max(st.leases, nm.GetLeases()), true
		}
	}
	for _, name := range order {
		st := nets[name]
		if st.hasLeases {
			ch <- gauge(descNetLeases, float64(st.leases), name)
		}
		if st.hasBytes {
			ch <- counter(descNetBytes, float64(st.sent), name, "sent")
			ch <- counter(descNetBytes, float64(st.received), name, "received")
		}
	}
}

// attestationFromRecord summarises the gate of a VM whose metrics call
// failed, by the rule the hypervisor's metrics use.
func attestationFromRecord(vm *hypervisorv1.VirtualMachine) hypervisorv1.AttestationState {
	return gate.Summary(vm.GetRequireAttestation(), vm.GetAttestation())
}

// collectNetwork sends a VM's network counters: the drops, flows and
// refusals its network counts for it.
func collectNetwork(ch chan<- prometheus.Metric, n *hypervisorv1.NetworkMetrics, id string) {
	net := n.GetName()
	ch <- counter(descNetDropped, float64(n.GetDroppedFrames()), net, id)
	byReason := func(d *prometheus.Desc, m map[string]int64) {
		for _, reason := range slices.Sorted(maps.Keys(m)) {
			ch <- counter(d, float64(m[reason]), net, id, reason)
		}
	}
	byReason(descEgressDropped, n.GetEgressDroppedByReason())
	byReason(descNATRefused, n.GetNatRefused())
	byReason(descDNSRefused, n.GetDnsRefused())
	ch <- gauge(descNATFlows, float64(n.GetNatTcpFlows()), net, id, "tcp")
	ch <- gauge(descNATFlows, float64(n.GetNatUdpFlows()), net, id, "udp")
	ch <- gauge(descIMDSConns, float64(n.GetImdsConnections()), net, id)
	ch <- counter(descIMDSDropped, float64(n.GetImdsConnectionsRefused()), net, id, "limit")
	ch <- counter(descIMDSDropped, float64(n.GetImdsConnectionsTimedOut()), net, id, "timeout")
}

func gauge(d *prometheus.Desc, v float64, labels ...string) prometheus.Metric {
	return constMetric(d, prometheus.GaugeValue, v, labels...)
}

func counter(d *prometheus.Desc, v float64, labels ...string) prometheus.Metric {
	return constMetric(d, prometheus.CounterValue, v, labels...)
}

// constMetric does not panic on a bad label value (not UTF-8): the metric
// becomes an error of the scrape, which serves the rest.
func constMetric(d *prometheus.Desc, t prometheus.ValueType, v float64, labels ...string) prometheus.Metric {
	m, err := prometheus.NewConstMetric(d, t, v, labels...)
	if err != nil {
		return prometheus.NewInvalidMetric(d, err)
	}
	return m
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

func seconds(ts *timestamppb.Timestamp) float64 {
	return float64(ts.GetSeconds()) + float64(ts.GetNanos())/1e9
}

func tsKey(ts *timestamppb.Timestamp) string {
	if ts == nil {
		return ""
	}
	return ts.AsTime().UTC().Format(time.RFC3339Nano)
}
