package tests

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
)

// BenchmarkFleetList measures what a fleet gateway adds to a list: a node
// gateway's own ListVirtualMachines over TLS (the baseline), the same list
// of one node through the fleet (one more hop), and the fleet's fan-out to
// all three nodes, merged. Three nodes on this machine with no VMs: the
// cost of the hops and the fan-out, not of a payload. Blocks of calls
// alternate between the three, so machine noise hits all alike.
func BenchmarkFleetList(b *testing.B) {
	images := b.TempDir()
	f := cluster.StartFleet(b, binDir, 3, cluster.Options{ImageDir: images, Quiet: true, LogLevel: "info"}, func(int) string { return "" })
	pem, err := os.ReadFile(f.CAFile)
	if err != nil {
		b.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(pem)
	nodeConn, err := grpc.NewClient(f.Nodes[0].Addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12})))
	if err != nil {
		b.Fatal(err)
	}
	defer nodeConn.Close()
	fleetConn, err := grpc.NewClient(f.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer fleetConn.Close()
	node, fleet := hypervisorv1.NewHypervisorServiceClient(nodeConn), hypervisorv1.NewHypervisorServiceClient(fleetConn)
	ctx := context.Background()
	list := func(c hypervisorv1.HypervisorServiceClient, req *hypervisorv1.ListVirtualMachinesRequest) func() error {
		return func() error {
			resp, err := c.ListVirtualMachines(ctx, req)
			if err == nil && len(resp.GetWarnings()) > 0 {
				err = fmt.Errorf("partial: %v", resp.GetWarnings())
			}
			return err
		}
	}
	surfaces := []struct {
		name string
		call func() error
		lat  []time.Duration
	}{
		{name: "node gateway (TLS)", call: list(node, &hypervisorv1.ListVirtualMachinesRequest{})},
		{name: "fleet, node=node-0", call: list(fleet, &hypervisorv1.ListVirtualMachinesRequest{Node: "node-0"})},
		{name: "fleet, fan-out to 3", call: list(fleet, &hypervisorv1.ListVirtualMachinesRequest{})},
	}
	for i := range surfaces {
		for range surfaceWarmup {
			if err := surfaces[i].call(); err != nil {
				b.Fatalf("%s warm-up: %v", surfaces[i].name, err)
			}
		}
	}
	n := surfaceCalls * b.N
	b.ResetTimer()
	for done := 0; done < n; done += surfaceBlock {
		for i := range surfaces {
			s := &surfaces[i]
			for range min(surfaceBlock, n-done) {
				start := time.Now()
				if err := s.call(); err != nil {
					b.Fatalf("%s: %v", s.name, err)
				}
				s.lat = append(s.lat, time.Since(start))
			}
		}
	}
	b.StopTimer()
	conns := connectionsTo(b, f.GatewayPid(), f)
	fmt.Printf("fleet gateway: %d TCP connections to the %d node gateways after the run\n", conns, len(f.Nodes))
	b.ReportMetric(float64(conns), "node-conns")
	base50, base99 := micros(quantile(surfaces[0].lat, 0.5)), micros(quantile(surfaces[0].lat, 0.99))
	fmt.Printf("ListVirtualMachines, %d sequential calls each, ratios to the node gateway's own:\n", n)
	fmt.Printf("  %-24s %10s %10s %10s %10s\n", "path", "p50", "p99", "p50 ratio", "p99 ratio")
	for i, s := range surfaces {
		p50, p99 := micros(quantile(s.lat, 0.5)), micros(quantile(s.lat, 0.99))
		fmt.Printf("  %-24s %8.0fµs %8.0fµs %10.2f %10.2f\n", s.name, p50, p99, p50/base50, p99/base99)
		b.ReportMetric(p50, fmt.Sprintf("s%d-p50-µs", i))
		b.ReportMetric(p50/base50, fmt.Sprintf("s%d-p50-ratio", i))
	}
}

// connectionsTo counts the established TCP connections process pid holds to
// the fleet's node gateways (its sockets' inodes in /proc/net/tcp with a
// node's port as the remote one).
func connectionsTo(b *testing.B, pid int, f *cluster.Fleet) int {
	b.Helper()
	ports := map[string]bool{}
	for _, n := range f.Nodes {
		_, port, _ := strings.Cut(n.Addr, ":")
		p, _ := strconv.Atoi(port)
		ports[fmt.Sprintf("%04X", p)] = true
	}
	inodes := map[string]bool{}
	fds, _ := filepath.Glob(fmt.Sprintf("/proc/%d/fd/*", pid))
	for _, fd := range fds {
		if l, err := os.Readlink(fd); err == nil && strings.HasPrefix(l, "socket:[") {
			inodes[strings.TrimSuffix(strings.TrimPrefix(l, "socket:["), "]")] = true
		}
	}
	raw, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		b.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(raw), "\n")[1:] {
		fs := strings.Fields(line)
		if len(fs) < 10 || fs[3] != "01" { // 01: ESTABLISHED
			continue
		}
		_, rport, _ := strings.Cut(fs[2], ":")
		if ports[rport] && inodes[fs[9]] {
			n++
		}
	}
	return n
}
