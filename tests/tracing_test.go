package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/tracing"
	"github.com/giantswarm/vm-manager/pkg/tracing/tracingtest"
	"github.com/giantswarm/vm-manager/tests/cluster"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
)

// Caller trace contexts, one per surface: each request continues its own.
const (
	mcpTrace  = "5a1f0000000000000000000000000001"
	restTrace = "5a1f0000000000000000000000000002"
	grpcTrace = "5a1f0000000000000000000000000003"
	callerID  = "00000000000000c1"
)

func traceparent(traceID string) string { return "00-" + traceID + "-" + callerID + "-01" }

// headerTransport sets one header on every request of a client.
type headerTransport struct{ key, value string }

func (h headerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set(h.key, h.value)
	return http.DefaultTransport.RoundTrip(r)
}

const (
	hvCreate      = "vmmanager.hypervisor.v1.HypervisorService/CreateVirtualMachine"
	atBeginBoot   = "vmmanager.attestation.v1.VerifierService/BeginBoot"
	atIssueNonce  = "vmmanager.attestation.v1.VerifierService/IssueNonce"
	atVerifyQuote = "vmmanager.attestation.v1.VerifierService/VerifyQuote"
)

// TestTracing runs the three binaries with --otlp-endpoint (by its
// variable) pointed at an OTLP receiver in the test, creates one VM through
// MCP (the guest attests, learn mode) and assembles the create's trace from
// what the processes exported: the gateway's HTTP and tool spans, the
// hypervisor's CreateVirtualMachine, and attestation's BeginBoot,
// IssueNonce and VerifyQuote below it, in the trace the caller started.
// REST and gRPC calls continue their callers' traces too; probes, the
// metrics scrape and the backends' own background work make none.
func TestTracing(t *testing.T) {
	images := cluster.GuestImages(t, "..")
	rcv := tracingtest.Start(t)
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, LearnGolden: true, LogLevel: "info", Env: []string{
		"VM_MANAGER_OTLP_ENDPOINT=" + rcv.HTTPEndpoint,
		"OTEL_BSP_SCHEDULE_DELAY=100", // ms: the SDK's batch delay, 5 s by default
	}})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })

	// Untraced: the probes, and the scrape with the telemetry reads it makes.
	for _, p := range []string{"/healthz", "/readyz", "/metrics"} {
		if code, _, _ := cluster.Do(t, "GET", "http://"+c.Addr+p, ""); code != 200 {
			t.Fatalf("GET %s: %d", p, code)
		}
	}

	// One create, through MCP, continuing the caller's trace.
	client := mcp.NewClient(&mcp.Implementation{Name: "vm-manager-tests", Version: "v0"}, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cs, err := client.Connect(ctx, &mcp.StreamableClientTransport{
		Endpoint:   "http://" + c.Addr + "/mcp",
		HTTPClient: &http.Client{Transport: headerTransport{"traceparent", traceparent(mcpTrace)}},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cs.Close()
	var userData string
	if err := json.Unmarshal([]byte(ignitionFile("/etc/traced", "yes")), &userData); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: "create_vm", Arguments: map[string]any{
		"name": "traced", "image": "test-guest", "cpus": 1, "memory_mib": 384, "require_attestation": true,
		"user_data": userData, "wait_for": "ready",
	}})
	if err != nil || res.IsError {
		t.Fatalf("create_vm: %v %+v", err, res)
	}
	t.Logf("create_vm took %s", time.Since(start).Round(time.Millisecond))
	var vms vmJSON
	if tc, ok := res.Content[0].(*mcp.TextContent); !ok || json.Unmarshal([]byte(tc.Text), &vms) != nil || vms.State != "ready" {
		t.Fatalf("create_vm: %+v", res.Content[0])
	}

	// REST and gRPC through the gateway, each with its caller's trace.
	if code, _, b := cluster.DoContext(ctx, t, "GET", a.base+"/vms/"+vms.ID, "", http.Header{"Traceparent": {traceparent(restTrace)}}); code != 200 {
		t.Fatalf("GET /vms/%s: %d %s", vms.ID, code, b)
	}
	conn, err := grpc.NewClient(c.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := hypervisorv1.NewHypervisorServiceClient(conn).GetHost(metadata.AppendToOutgoingContext(ctx, "traceparent", traceparent(grpcTrace)), &hypervisorv1.GetHostRequest{}); err != nil {
		t.Fatal(err)
	}

	isServer := func(service, name string) func(tracingtest.Span) bool {
		return func(s tracingtest.Span) bool {
			return s.Service == service && s.Name == name && s.Kind == tracepb.Span_SPAN_KIND_SERVER
		}
	}
	var tree *tracingtest.Tree
	cluster.Eventually(t, 30*time.Second, "the create's spans", func() error {
		var ok bool
		tree, ok = tracingtest.TraceOf(rcv.Spans(), func(s tracingtest.Span) bool { return s.Name == "tools/call create_vm" })
		if !ok {
			return fmt.Errorf("no tools/call span among %d", len(rcv.Spans()))
		}
		// Each process sends its spans in its own batches, a parent after
		// its children: wait for all of them (both quotes: initrd and ready).
		for want, n := range map[string]int{hvCreate: 1, atBeginBoot: 1, atIssueNonce: 1, atVerifyQuote: 2} {
			service := tracing.Attestation
			if want == hvCreate {
				service = tracing.Hypervisor
			}
			if len(tree.Find(isServer(service, want))) < n {
				return fmt.Errorf("incomplete:\n%s", tree)
			}
		}
		for _, o := range tree.Orphans() {
			if o.ParentID != callerID {
				return fmt.Errorf("waiting for the parent of %s:\n%s", o, tree)
			}
		}
		return nil
	})
	t.Logf("the create's trace (%d spans):\n%s", len(tree.Spans), tree)

	tool := tree.Find(func(s tracingtest.Span) bool { return s.Name == "tools/call create_vm" })[0]
	if tool.TraceID != mcpTrace || tool.Service != tracing.Gateway || tool.Attrs["gen_ai.tool.name"] != "create_vm" || tool.Attrs["mcp.method.name"] != "tools/call" {
		t.Errorf("tool span %s: trace %s, attributes %v", tool, tool.TraceID, tool.Attrs)
	}
	if p := tree.Path(tool); p[0].Name != "POST /mcp" || p[0].ParentID != callerID {
		t.Errorf("the tool span's root is %s, want the gateway's POST /mcp under the caller's span", p[0])
	}
	// Only the caller's own span is missing: the gateway's HTTP spans of the
	// session (initialize, the tool call, …) are its children.
	for _, o := range tree.Orphans() {
		if o.Service != tracing.Gateway || o.ParentID != callerID || o.Kind != tracepb.Span_SPAN_KIND_SERVER || !strings.HasSuffix(o.Name, " /mcp") {
			t.Errorf("span whose parent is not in the trace: %s", o)
		}
	}
	create := tree.Find(isServer(tracing.Hypervisor, hvCreate))
	if len(create) != 1 || !tree.Descends(create[0], tool) {
		t.Fatalf("CreateVirtualMachine %v is not below the tool span", create)
	}
	for _, name := range []string{atBeginBoot, atIssueNonce, atVerifyQuote} {
		for _, s := range tree.Find(isServer(tracing.Attestation, name)) {
			if !tree.Descends(s, create[0]) {
				t.Errorf("%s is not below CreateVirtualMachine: %v", s, tree.Path(s))
			}
		}
	}
	if imdsSpans := tree.Find(func(s tracingtest.Span) bool { return s.Name == "IMDS POST /giantswarm/v1/attest/quote" }); len(imdsSpans) < 2 || imdsSpans[0].Attrs["vm_manager.vm.id"] != vms.ID {
		t.Errorf("IMDS quote spans %v", imdsSpans)
	}

	// REST and gRPC: each in its caller's trace, down to the hypervisor.
	for _, want := range []struct{ trace, gateway, hypervisor string }{
		{restTrace, "GET /api/v1/vms/{id}", "vmmanager.hypervisor.v1.HypervisorService/GetVirtualMachine"},
		{grpcTrace, "vmmanager.hypervisor.v1.HypervisorService/GetHost", "vmmanager.hypervisor.v1.HypervisorService/GetHost"},
	} {
		var tr *tracingtest.Tree
		cluster.Eventually(t, 10*time.Second, want.gateway, func() error {
			var ok bool
			if tr, ok = tracingtest.TraceOf(rcv.Spans(), func(s tracingtest.Span) bool { return s.TraceID == want.trace }); !ok ||
				len(tr.Find(isServer(tracing.Gateway, want.gateway))) != 1 || len(tr.Find(isServer(tracing.Hypervisor, want.hypervisor))) != 1 {
				return fmt.Errorf("trace %s incomplete: %v", want.trace, tr)
			}
			return nil
		})
		gw := tr.Find(isServer(tracing.Gateway, want.gateway))[0]
		hv := tr.Find(isServer(tracing.Hypervisor, want.hypervisor))[0]
		if gw.ParentID != callerID || !tr.Descends(hv, gw) {
			t.Errorf("trace %s:\n%s", want.trace, tr)
		}
	}

	// Nothing of the probes, the scrape or background work.
	for _, s := range rcv.Spans() {
		if strings.Contains(s.Name, "Health/") || strings.Contains(s.Name, "TelemetryService/") || strings.Contains(s.Name, "healthz") ||
			strings.Contains(s.Name, "readyz") || strings.Contains(s.Name, "/metrics") || strings.Contains(s.Name, "PolicySync") {
			t.Errorf("span of a probe, scrape or background task: %s", s)
		}
		if s.ParentID == "" && s.Service != tracing.Gateway {
			t.Errorf("a backend started a trace of its own: %s", s)
		}
	}
	if rcv.Requests("http/protobuf") == 0 {
		t.Error("no export over http/protobuf")
	}
}
