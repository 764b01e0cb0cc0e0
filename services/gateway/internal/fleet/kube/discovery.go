package kube

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/services/gateway/internal/fleet"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/klog/v2"
)

// namespaceFile is where the pod's service account tells its namespace.
const namespaceFile = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

// Config selects the node pods' EndpointSlices and how a member is named.
type Config struct {
	// Namespace of the Service; empty: the pod's own (its service account's).
	Namespace string
	// Service is the node pods' headless Service (the slices' label
	// kubernetes.io/service-name).
	Service string
	// PortName is the node gateways' gRPC port in the slices.
	PortName string
	// ServerNameSuffix, if set, makes a member's ServerName
	// <hostname>.<suffix> (e.g. vmm-nodes.vmm.svc): the name in the node
	// gateway's certificate, while the pod IP is what is dialled.
	ServerNameSuffix string
	// Debounce gathers a burst of slice events (a rollout) into one update.
	Debounce time.Duration
	// Resync re-delivers every slice this often; a missed event cannot
	// leave the set stale for longer.
	Resync time.Duration
}

// Flags defines the Kubernetes discovery's flags on fs.
func Flags(fs *cli.FlagSet) func() Config {
	ns := fs.String("fleet-namespace", "VM_MANAGER_FLEET_NAMESPACE", "", "namespace of --fleet-service (default: the pod's own, from its service account)")
	svc := fs.String("fleet-service", "VM_MANAGER_FLEET_SERVICE", "", "headless Service of the node pods whose EndpointSlices are the fleet (--fleet-discovery kubernetes)")
	port := fs.String("fleet-port-name", "VM_MANAGER_FLEET_PORT_NAME", "grpc", "name of the node gateways' gRPC port in the Service's EndpointSlices")
	suffix := fs.String("fleet-server-name-suffix", "VM_MANAGER_FLEET_SERVER_NAME_SUFFIX", "", "verify a node gateway's certificate for <pod hostname>.<suffix> (e.g. vmm-nodes.vmm.svc) instead of its pod IP")
	return func() Config {
		return Config{Namespace: *ns, Service: *svc, PortName: *port, ServerNameSuffix: *suffix,
			Debounce: 200 * time.Millisecond, Resync: 10 * time.Minute}
	}
}

// Slices is the part of a discovery/v1 EndpointSlices client of one
// namespace the discovery uses: the in-cluster one (restSlices), or
// client-go's fake clientset's in tests.
type Slices interface {
	List(ctx context.Context, opts metav1.ListOptions) (*discoveryv1.EndpointSliceList, error)
	Watch(ctx context.Context, opts metav1.ListOptions) (watch.Interface, error)
}

// Discovery follows the EndpointSlices of Config.Service: a fleet.Discovery.
type Discovery struct {
	client Slices
	cfg    Config
	log    *slog.Logger
}

// New returns a Discovery over client, the slices of cfg.Namespace (which
// must be set; see NewInCluster for the default).
func New(client Slices, cfg Config, log *slog.Logger) (*Discovery, error) {
	var missing []string
	if cfg.Namespace == "" {
		missing = append(missing, "namespace (--fleet-namespace)")
	}
	if cfg.Service == "" {
		missing = append(missing, "service (--fleet-service)")
	}
	if cfg.PortName == "" {
		missing = append(missing, "port name (--fleet-port-name)")
	}
	if len(missing) > 0 {
		return nil, fmt.Errorf("kubernetes discovery needs a %s", strings.Join(missing, ", a "))
	}
	return &Discovery{client: client, cfg: cfg, log: log.With("service", cfg.Namespace+"/"+cfg.Service)}, nil
}

// NewInCluster is New with the pod's service account: the API server from
// the pod's environment, the namespace defaulting to the pod's own. Its
// client's own logs (watch errors, retries) go to log.
func NewInCluster(cfg Config, log *slog.Logger) (*Discovery, error) {
	rc, err := rest.InClusterConfig()
	if err != nil {
		return nil, fmt.Errorf("kubernetes discovery: %w", err)
	}
	rc.UserAgent = "vmm-gateway (fleet discovery)"
	if cfg.Namespace == "" {
		b, err := os.ReadFile(namespaceFile)
		if err != nil {
			return nil, fmt.Errorf("kubernetes discovery: no --fleet-namespace and the pod's own is unknown: %w", err)
		}
		cfg.Namespace = strings.TrimSpace(string(b))
	}
	client, err := newRESTSlices(rc, cfg.Namespace)
	if err != nil {
		return nil, fmt.Errorf("kubernetes discovery: %w", err)
	}
	// client-go logs through klog: into the process's structured log.
	klog.SetSlogLogger(log.With("component", "client-go"))
	return New(client, cfg, log)
}

// Run follows the slices and calls update with the whole set: once the
// informer's first list is in, then after each change (a burst gathered
// for cfg.Debounce) that changes the set.
func (d *Discovery) Run(ctx context.Context, update func([]fleet.Member)) error {
	selector := discoveryv1.LabelServiceName + "=" + d.cfg.Service
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.LabelSelector = selector
			return d.client.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.LabelSelector = selector
			return d.client.Watch(ctx, o)
		},
	}
	// A list, then a watch from its resourceVersion: what every API server
	// (and the fake clientset) serves; a streaming list gains nothing for
	// one Service's few slices.
	inf := cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(lw, listThenWatch{}),
		&discoveryv1.EndpointSlice{}, d.cfg.Resync, cache.Indexers{})
	changed := make(chan struct{}, 1)
	poke := func() {
		select {
		case changed <- struct{}{}:
		default:
		}
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { poke() },
		UpdateFunc: func(any, any) { poke() },
		DeleteFunc: func(any) { poke() },
	}); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { inf.RunWithContext(ctx) })
	defer wg.Wait()
	defer cancel()
	d.log.Info("fleet discovery: watching EndpointSlices", "selector", selector)
	if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
		return nil // ctx ended before the first list
	}
	var last []fleet.Member
	var lastSkips []Skip
	first := true
	report := func() {
		var in []*discoveryv1.EndpointSlice
		for _, o := range inf.GetStore().List() {
			if s, ok := o.(*discoveryv1.EndpointSlice); ok {
				in = append(in, s)
			}
		}
		members, skips := Members(in, d.cfg)
		if !slices.Equal(skips, lastSkips) {
			for _, s := range skips {
				d.log.Warn("fleet discovery: endpoint skipped", "endpoint", s.String())
			}
			lastSkips = skips
		}
		if !first && slices.Equal(members, last) {
			return
		}
		first, last = false, members
		d.log.Info("fleet discovery: members", "members", describe(members))
		update(slices.Clone(members))
	}
	report()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-changed:
		}
		t := time.NewTimer(d.cfg.Debounce)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
		// Events during the wait poked changed again: drain it, this
		// report sees them.
		select {
		case <-changed:
		default:
		}
		report()
	}
}

func describe(ms []fleet.Member) string {
	if len(ms) == 0 {
		return "none"
	}
	parts := make([]string, len(ms))
	for i, m := range ms {
		state := "ready"
		if !m.Ready {
			state = "not ready"
		}
		parts[i] = fmt.Sprintf("%s=%d@%s (%s, node %s)", m.Name, m.Index, m.Addr, state, m.NodeName)
	}
	return strings.Join(parts, ", ")
}

var _ fleet.Discovery = (*Discovery)(nil)

// listThenWatch tells the informer's reflector not to try a streaming list.
type listThenWatch struct{}

func (listThenWatch) IsWatchListSemanticsUnSupported() bool { return true }
