package tests

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/client"
	"github.com/giantswarm/vm-manager/tests/cluster"
)

// BenchmarkExecStream measures, side by side on one guest through the
// gateway's gRPC: the unary exec and the streamed one of the same ~1 MB of
// output (within the unary cap), a streamed 8 MiB, and a streamed `true`
// (what opening a session costs: SSH handshake and the command).
func BenchmarkExecStream(b *testing.B) {
	images := cluster.GuestImages(b, "..")
	c := cluster.Start(b, cluster.Processes, binDir, cluster.Options{ImageDir: images, Quiet: true})
	base := "http://" + c.Addr + "/api/v1"
	code, _, body := cluster.Do(b, "POST", base+"/vms", `{"name":"execbench","image":"test-guest","require_attestation":false,"memory_mib":512,"cpus":1}`)
	if code != http.StatusCreated {
		b.Fatalf("create: %d %s", code, body)
	}
	var vm vmJSON
	if err := json.Unmarshal(body, &vm); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cluster.Do(b, "DELETE", base+"/vms/"+vm.ID, "") })
	cl, err := client.Dial(c.Addr)
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	ctx := context.Background()

	const small = 1000000
	stream := func(argv ...string) (int, time.Duration) {
		began := time.Now()
		s, err := cl.Hypervisor.ExecVirtualMachineStream(ctx)
		if err != nil {
			b.Fatal(err)
		}
		_ = s.Send(&hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_Start{Start: &hypervisorv1.ExecStart{Id: vm.ID, Command: argv}}})
		n := 0
		for {
			r, err := s.Recv()
			if err != nil {
				b.Fatalf("stream %v: %v", argv, err)
			}
			if r.GetExit() != nil {
				return n, time.Since(began)
			}
			n += len(r.GetStdout())
		}
	}
	var unaryD, streamD, bigD, openD time.Duration
	var bigN int
	for range b.N {
		began := time.Now()
		r, err := cl.Hypervisor.ExecVirtualMachine(ctx, &hypervisorv1.ExecVirtualMachineRequest{Id: vm.ID, Command: []string{"head", "-c", "1000000", "/dev/zero"}})
		if err != nil || len(r.GetStdout()) != small {
			b.Fatalf("unary: %d bytes, %v", len(r.GetStdout()), err)
		}
		unaryD += time.Since(began)
		n, d := stream("head", "-c", "1000000", "/dev/zero")
		if n != small {
			b.Fatalf("streamed %d bytes", n)
		}
		streamD += d
		n, d = stream("head", "-c", "8388608", "/dev/zero")
		bigN += n
		bigD += d
		_, d = stream("true")
		openD += d
	}
	per := func(d time.Duration) float64 { return d.Seconds() / float64(b.N) }
	b.ReportMetric(per(unaryD), "unary_1MB_s")
	b.ReportMetric(per(streamD), "stream_1MB_s")
	b.ReportMetric(float64(streamD)/float64(unaryD), "stream/unary")
	b.ReportMetric(float64(bigN)/bigD.Seconds()/(1<<20), "stream_MiB/s")
	b.ReportMetric(per(openD)*1000, "open_true_ms")
}
