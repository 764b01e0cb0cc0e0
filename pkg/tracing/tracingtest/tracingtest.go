// Package tracingtest is a small OTLP receiver for tests: it takes traces
// over OTLP/HTTP (protobuf) and OTLP/gRPC on loopback, the way a collector
// would, and keeps their spans for the test to assemble into trees.
package tracingtest

import (
	"compress/gzip"
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"

	collectorpb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// Span is one received span, flattened.
type Span struct {
	Service  string // the resource's service.name
	TraceID  string // hex
	SpanID   string
	ParentID string // "" for a root
	Name     string
	Kind     tracepb.Span_SpanKind
	Attrs    map[string]string // values as strings
	Resource map[string]string
	Error    bool // status code error
}

func (s Span) String() string {
	return fmt.Sprintf("%s %q %s (span %s, parent %s)", s.Service, s.Name, strings.TrimPrefix(s.Kind.String(), "SPAN_KIND_"), s.SpanID, s.ParentID)
}

// Receiver is an OTLP receiver on loopback.
type Receiver struct {
	// HTTPEndpoint is the OTLP/HTTP base URL ("http://127.0.0.1:port"):
	// spans are posted to its /v1/traces. GRPCEndpoint is the OTLP/gRPC one.
	HTTPEndpoint, GRPCEndpoint string

	mu    sync.Mutex
	spans []Span
	// Requests counts the export requests received per protocol.
	requests map[string]int
}

// Start runs a receiver until the test ends.
func Start(t testing.TB) *Receiver {
	t.Helper()
	r := &Receiver{requests: map[string]int{}}

	hl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/traces", r.serveHTTP)
	hs := &http.Server{Handler: mux}
	go func() { _ = hs.Serve(hl) }()
	t.Cleanup(func() { hs.Close() })
	r.HTTPEndpoint = "http://" + hl.Addr().String()

	gl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	collectorpb.RegisterTraceServiceServer(gs, grpcService{r: r})
	go func() { _ = gs.Serve(gl) }()
	t.Cleanup(gs.Stop)
	r.GRPCEndpoint = "http://" + gl.Addr().String()
	return r
}

func (r *Receiver) serveHTTP(w http.ResponseWriter, req *http.Request) {
	var body io.Reader = req.Body
	if req.Header.Get("Content-Encoding") == "gzip" {
		zr, err := gzip.NewReader(req.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		body = zr
	}
	b, err := io.ReadAll(io.LimitReader(body, 64<<20))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var in collectorpb.ExportTraceServiceRequest
	if err := proto.Unmarshal(b, &in); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	r.add("http/protobuf", &in)
	out, _ := proto.Marshal(&collectorpb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

type grpcService struct {
	collectorpb.UnimplementedTraceServiceServer
	r *Receiver
}

func (g grpcService) Export(_ context.Context, in *collectorpb.ExportTraceServiceRequest) (*collectorpb.ExportTraceServiceResponse, error) {
	g.r.add("grpc", in)
	return &collectorpb.ExportTraceServiceResponse{}, nil
}

func (r *Receiver) add(protocol string, in *collectorpb.ExportTraceServiceRequest) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.requests[protocol]++
	for _, rs := range in.GetResourceSpans() {
		res := attrs(rs.GetResource().GetAttributes())
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				r.spans = append(r.spans, Span{
					Service:  res["service.name"],
					TraceID:  hex.EncodeToString(s.GetTraceId()),
					SpanID:   hex.EncodeToString(s.GetSpanId()),
					ParentID: hex.EncodeToString(s.GetParentSpanId()),
					Name:     s.GetName(),
					Kind:     s.GetKind(),
					Attrs:    attrs(s.GetAttributes()),
					Resource: res,
					Error:    s.GetStatus().GetCode() == tracepb.Status_STATUS_CODE_ERROR,
				})
			}
		}
	}
}

func attrs(kvs []*commonpb.KeyValue) map[string]string {
	m := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		v := kv.GetValue()
		switch {
		case v.GetStringValue() != "":
			m[kv.GetKey()] = v.GetStringValue()
		default:
			m[kv.GetKey()] = strings.TrimSpace(fmt.Sprint(v.GetValue()))
		}
	}
	return m
}

// Spans returns a copy of what was received so far.
func (r *Receiver) Spans() []Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.spans)
}

// Requests is the number of export requests received over protocol
// ("http/protobuf", "grpc").
func (r *Receiver) Requests(protocol string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.requests[protocol]
}

// Tree is the spans of one trace.
type Tree struct {
	Spans []Span
	byID  map[string]Span
}

// TraceOf returns the trace of the first span match accepts, and whether
// there is one.
func TraceOf(spans []Span, match func(Span) bool) (*Tree, bool) {
	for _, s := range spans {
		if match(s) {
			t := &Tree{byID: map[string]Span{}}
			for _, o := range spans {
				if o.TraceID == s.TraceID {
					t.Spans = append(t.Spans, o)
					t.byID[o.SpanID] = o
				}
			}
			return t, true
		}
	}
	return nil, false
}

// Find returns the spans match accepts.
func (t *Tree) Find(match func(Span) bool) []Span {
	var out []Span
	for _, s := range t.Spans {
		if match(s) {
			out = append(out, s)
		}
	}
	return out
}

// Path is the chain of spans from the root down to s.
func (t *Tree) Path(s Span) []Span {
	path := []Span{s}
	for s.ParentID != "" {
		p, ok := t.byID[s.ParentID]
		if !ok {
			break
		}
		path = append(path, p)
		s = p
	}
	slices.Reverse(path)
	return path
}

// Descends says whether s has ancestor a.
func (t *Tree) Descends(s, a Span) bool {
	for _, p := range t.Path(s)[:len(t.Path(s))-1] {
		if p.SpanID == a.SpanID {
			return true
		}
	}
	return false
}

// Orphans are the spans whose parent is not in the trace.
func (t *Tree) Orphans() []Span {
	var out []Span
	for _, s := range t.Spans {
		if _, ok := t.byID[s.ParentID]; s.ParentID != "" && !ok {
			out = append(out, s)
		}
	}
	return out
}

// Roots are the spans without a parent.
func (t *Tree) Roots() []Span {
	return t.Find(func(s Span) bool { return s.ParentID == "" })
}

// String draws the tree, one span a line, children indented.
func (t *Tree) String() string {
	children := map[string][]Span{}
	for _, s := range t.Spans {
		children[s.ParentID] = append(children[s.ParentID], s)
	}
	var b strings.Builder
	var walk func(parent string, depth int)
	walk = func(parent string, depth int) {
		kids := children[parent]
		sort.SliceStable(kids, func(i, j int) bool { return kids[i].Name < kids[j].Name })
		for _, s := range kids {
			fmt.Fprintf(&b, "%s%s: %s [%s]\n", strings.Repeat("  ", depth), s.Service, s.Name, strings.TrimPrefix(s.Kind.String(), "SPAN_KIND_"))
			walk(s.SpanID, depth+1)
		}
	}
	walk("", 0)
	for _, o := range t.Orphans() {
		fmt.Fprintf(&b, "(orphan) %s\n", o)
		walk(o.SpanID, 1)
	}
	return b.String()
}
