package mcp

import (
	"bytes"
	"net/http"
	"strings"
	"testing"
)

// BenchmarkToolCall is one tools/call (get_host, against the fake
// backend) per iteration on an open session, answered as plain JSON and
// as SSE: what collecting the SDK's stream costs a JSON-only client.
func BenchmarkToolCall(b *testing.B) {
	_, url := rawHarness(b)
	const call = `{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"get_host","arguments":{}}}`
	for _, bc := range []struct{ name, accept, want string }{{"json", jsonOnly, "application/json"}, {"sse", both, "text/event-stream"}} {
		b.Run(bc.name, func(b *testing.B) {
			c := &rawMCP{t: b, url: url}
			c.initialize(bc.accept)
			b.ReportAllocs()
			for b.Loop() {
				req, _ := http.NewRequest("POST", url, strings.NewReader(call))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Accept", bc.accept)
				req.Header.Set("Mcp-Session-Id", c.session)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					b.Fatal(err)
				}
				var buf bytes.Buffer
				_, _ = buf.ReadFrom(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), bc.want) || !strings.Contains(buf.String(), `"node1"`) {
					b.Fatalf("%d %s", resp.StatusCode, buf.String())
				}
			}
		})
	}
}
