package mcp

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"mime"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	attestationv1 "github.com/giantswarm/vm-manager/gen/vmmanager/attestation/v1"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/gateway/internal/restjson"
)

// rawMCP speaks MCP's streamable HTTP by hand, as curl or a simple client
// does: a POST with a JSON-RPC body and the Accept header it chooses.
type rawMCP struct {
	t       testing.TB
	url     string
	session string
}

type rawReply struct {
	status int
	header http.Header
	body   []byte
}

// mediaType is the reply's Content-Type without parameters.
func (r rawReply) mediaType() string {
	mt, _, _ := mime.ParseMediaType(r.header.Get("Content-Type"))
	return mt
}

func (c *rawMCP) post(accept, body string, hdr ...string) rawReply {
	c.t.Helper()
	req, err := http.NewRequest("POST", c.url, strings.NewReader(body))
	if err != nil {
		c.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if accept != "" {
		req.Header.Set("Accept", accept)
	}
	if c.session != "" {
		req.Header.Set("Mcp-Session-Id", c.session)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	// A bound against a hang, not a speed check: TestHostileArguments' 9 MiB
	// body takes ~10 s to parse under the race detector, 25+ s on a loaded
	// machine.
	client := &http.Client{Timeout: 2 * time.Minute}
	resp, err := client.Do(req)
	if err != nil {
		c.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		c.t.Fatal(err)
	}
	return rawReply{resp.StatusCode, resp.Header, b}
}

const initializeBody = `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"curl","version":"8"}}}`

// initialize opens a session with the given Accept and returns the reply.
func (c *rawMCP) initialize(accept string) rawReply {
	c.t.Helper()
	r := c.post(accept, initializeBody)
	if r.status != http.StatusOK {
		c.t.Fatalf("initialize: %d %s", r.status, r.body)
	}
	c.session = r.header.Get("Mcp-Session-Id")
	if c.session == "" {
		c.t.Fatalf("initialize: no Mcp-Session-Id: %v", r.header)
	}
	if n := c.post(accept, `{"jsonrpc":"2.0","method":"notifications/initialized"}`); n.status != http.StatusAccepted {
		c.t.Fatalf("notifications/initialized: %d %s", n.status, n.body)
	}
	return r
}

// rpcResponse is a JSON-RPC response with a tool result or a tool list in it.
type rpcResponse struct {
	ID     int `json:"id"`
	Result struct {
		ServerInfo struct{ Name string } `json:"serverInfo"`
		Tools      []struct {
			Name         string         `json:"name"`
			OutputSchema map[string]any `json:"outputSchema"`
		} `json:"tools"`
		Content []struct {
			Type, Text string
		} `json:"content"`
		StructuredContent map[string]any `json:"structuredContent"`
		IsError           bool           `json:"isError"`
	} `json:"result"`
	Error *struct {
		Code    int
		Message string
	} `json:"error"`
}

// jsonReply is a plain JSON answer: one JSON-RPC response, no SSE framing.
func jsonReply(t *testing.T, r rawReply) rpcResponse {
	t.Helper()
	if r.status != http.StatusOK || r.mediaType() != "application/json" {
		t.Fatalf("want a 200 application/json answer, got %d %q:\n%s", r.status, r.header.Get("Content-Type"), r.body)
	}
	var resp rpcResponse
	if err := json.Unmarshal(r.body, &resp); err != nil {
		t.Fatalf("not one JSON-RPC response: %v\n%s", err, r.body)
	}
	if resp.Error != nil {
		t.Fatalf("JSON-RPC error %d: %s", resp.Error.Code, resp.Error.Message)
	}
	return resp
}

// sseReply is an SSE answer: the responses among its events.
func sseReply(t *testing.T, r rawReply) []rpcResponse {
	t.Helper()
	if r.status != http.StatusOK || r.mediaType() != "text/event-stream" {
		t.Fatalf("want a 200 text/event-stream answer, got %d %q:\n%s", r.status, r.header.Get("Content-Type"), r.body)
	}
	var out []rpcResponse
	sc := bufio.NewScanner(bytes.NewReader(r.body))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || !strings.Contains(data, `"result"`) {
			continue
		}
		var resp rpcResponse
		if err := json.Unmarshal([]byte(data), &resp); err != nil {
			t.Fatalf("event data: %v: %s", err, data)
		}
		out = append(out, resp)
	}
	if len(out) == 0 {
		t.Fatalf("no response in the stream:\n%s", r.body)
	}
	return out
}

const (
	jsonOnly = "application/json"
	both     = "application/json, text/event-stream"
)

func rawHarness(t testing.TB) (*harness, string) {
	h := newHarness(t)
	ts := httptest.NewServer(New(hypervisorv1.NewHypervisorServiceClient(h.conn), attestationv1.NewAttestationServiceClient(h.conn), nil, nil))
	t.Cleanup(ts.Close)
	return h, ts.URL
}

// TestJSONOnlyClient: a client that accepts only JSON (curl -H 'Accept:
// application/json') initializes, lists the tools and calls them, and
// gets plain JSON-RPC bodies, as the original answered; a long create_vm
// returns its result without progress.
func TestJSONOnlyClient(t *testing.T) {
	h, url := rawHarness(t)
	for _, accept := range []string{jsonOnly, "application/json;q=1, text/event-stream;q=0", "*/*", ""} {
		t.Run("Accept "+accept, func(t *testing.T) {
			c := &rawMCP{t: t, url: url}
			if init := jsonReply(t, c.initialize(accept)); init.ID != 1 || init.Result.ServerInfo.Name != ServerName {
				t.Errorf("initialize: %+v", init)
			}
			lt := jsonReply(t, c.post(accept, `{"jsonrpc":"2.0","id":2,"method":"tools/list"}`))
			var names []string
			for _, tool := range lt.Result.Tools {
				names = append(names, tool.Name)
				if tool.OutputSchema["type"] != "object" {
					t.Errorf("%s: outputSchema %v", tool.Name, tool.OutputSchema)
				}
			}
			if !slices.Equal(names, slices.Sorted(slices.Values(ToolNames))) {
				t.Errorf("tools/list: %v", names)
			}
			call := jsonReply(t, c.post(accept, `{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"get_host","arguments":{}}}`))
			want, _ := restjson.Marshaler{}.Marshal(h.hv.host)
			if call.ID != 3 || call.Result.IsError || len(call.Result.Content) != 1 || call.Result.Content[0].Text != string(want) || call.Result.StructuredContent["hostname"] != "node1" {
				t.Errorf("tools/call get_host: %+v", call)
			}
		})
	}
	t.Run("a long call, with a progress token", func(t *testing.T) {
		c := &rawMCP{t: t, url: url}
		c.initialize(jsonOnly)
		start := time.Now()
		r := c.post(jsonOnly, `{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"create_vm","arguments":{"name":"worker-1"},"_meta":{"progressToken":"p1"}}}`)
		res := jsonReply(t, r)
		if time.Since(start) < 2*time.Second || res.Result.IsError || res.Result.StructuredContent["state"] != "ready" {
			t.Errorf("create_vm after %v: %s", time.Since(start), r.body)
		}
		if bytes.Contains(r.body, []byte("notifications/progress")) {
			t.Errorf("progress in a JSON answer: %s", r.body)
		}
	})
}

// TestSSEClient: a client whose Accept names text/event-stream gets the
// answer as an SSE stream, progress notifications included; one naming
// only text/event-stream too (the SDK alone would refuse it).
func TestSSEClient(t *testing.T) {
	_, url := rawHarness(t)
	for _, accept := range []string{both, "text/event-stream"} {
		t.Run("Accept "+accept, func(t *testing.T) {
			c := &rawMCP{t: t, url: url}
			sseReply(t, c.initialize(accept))
			r := c.post(accept, `{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"get_info","arguments":{}}}`)
			if res := sseReply(t, r); res[0].ID != 2 || res[0].Result.StructuredContent["version"] == nil {
				t.Errorf("get_info: %s", r.body)
			}
		})
	}
	c := &rawMCP{t: t, url: url}
	c.initialize(both)
	r := c.post(both, `{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"create_vm","arguments":{"name":"worker-2"},"_meta":{"progressToken":"p2"}}}`)
	if res := sseReply(t, r); res[0].Result.StructuredContent["state"] != "ready" || !bytes.Contains(r.body, []byte(`"method":"notifications/progress"`)) {
		t.Errorf("create_vm over SSE, with progress: %s", r.body)
	}
}

// TestSessionAcrossTransports: a session serves both kinds of request,
// whichever opened it.
func TestSessionAcrossTransports(t *testing.T) {
	_, url := rawHarness(t)
	getInfo := `{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"get_info","arguments":{}}}`
	for _, open := range []string{jsonOnly, both} {
		c := &rawMCP{t: t, url: url}
		c.initialize(open)
		jsonReply(t, c.post(jsonOnly, getInfo))
		sseReply(t, c.post(both, getInfo))
		jsonReply(t, c.post(jsonOnly, getInfo))
	}
}

// TestJSONOnlyBatch: a JSON-RPC batch (protocol 2025-03-26) gets an array.
func TestJSONOnlyBatch(t *testing.T) {
	_, url := rawHarness(t)
	c := &rawMCP{t: t, url: url}
	c.initialize(jsonOnly)
	r := c.post(jsonOnly, ` [{"jsonrpc":"2.0","id":1,"method":"tools/list"},{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"get_info"}}]`,
		"MCP-Protocol-Version", "2025-03-26")
	var resps []rpcResponse
	if r.status != http.StatusOK || r.mediaType() != "application/json" || json.Unmarshal(r.body, &resps) != nil || len(resps) != 2 {
		t.Fatalf("batch: %d %v %s", r.status, r.header, r.body)
	}
	ids := []int{resps[0].ID, resps[1].ID}
	slices.Sort(ids)
	if !slices.Equal(ids, []int{1, 2}) {
		t.Errorf("batch ids %v", ids)
	}
}

// TestJSONOnlyErrorsPassThrough: what the SDK refuses reaches a JSON-only
// client unchanged.
func TestJSONOnlyErrorsPassThrough(t *testing.T) {
	_, url := rawHarness(t)
	c := &rawMCP{t: t, url: url, session: "no-such-session"}
	if r := c.post(jsonOnly, `{"jsonrpc":"2.0","id":1,"method":"tools/list"}`); r.status != http.StatusNotFound || !strings.Contains(string(r.body), "session not found") {
		t.Errorf("unknown session: %d %s", r.status, r.body)
	}
	c.session = ""
	if r := c.post(jsonOnly, `{"jsonrpc":"2.0","id":1,"method":"tools/list"}`, "Content-Type", "text/plain"); r.status != http.StatusUnsupportedMediaType {
		t.Errorf("text/plain body: %d %s", r.status, r.body)
	}
	if r := c.post(jsonOnly, `{"jsonrpc":"2.0","id":1,"method":"no/such"}`); r.status != http.StatusBadRequest {
		t.Errorf("unknown method: %d %s", r.status, r.body)
	}
}
