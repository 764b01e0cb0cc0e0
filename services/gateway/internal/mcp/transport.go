package mcp

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"mime"
	"net/http"
	"strconv"
	"strings"
)

// negotiate chooses, per POST, how the answer travels: as an SSE stream when
// the client's Accept names text/event-stream, as one plain JSON-RPC body
// otherwise (Accept: application/json, */* or none), as the original
// answered curl and other simple clients.
//
// The SDK's own JSON mode (StreamableHTTPOptions.JSONResponse) is fixed per
// handler and session, and its handler refuses a POST whose Accept lacks
// either type. So one SDK handler always streams, keeping one set of
// sessions for both kinds of client, and a JSON answer is its stream
// collected: the responses are kept, the messages beside them (progress
// notifications) are dropped, as a JSON-only client cannot receive them.
func negotiate(sdk http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			sdk.ServeHTTP(w, r)
			return
		}
		sse := accepts(r.Header.Values("Accept"), "text/event-stream")
		r2 := r.Clone(r.Context())
		r2.Header.Set("Accept", "application/json, text/event-stream") // what the SDK insists on
		if sse {
			sdk.ServeHTTP(w, r2)
			return
		}
		body := bufio.NewReader(r.Body)
		r2.Body = readCloser{body, r.Body}
		jw := &jsonWriter{w: w, batch: firstByte(body) == '['}
		sdk.ServeHTTP(jw, r2)
		jw.finish()
	})
}

// accepts reports whether an Accept header names typ itself (not only by a
// wildcard) with a non-zero quality.
func accepts(values []string, typ string) bool {
	for _, v := range values {
		for _, part := range strings.Split(v, ",") {
			mt, params, err := mime.ParseMediaType(strings.TrimSpace(part))
			if err != nil || !strings.EqualFold(mt, typ) {
				continue
			}
			if q, err := strconv.ParseFloat(params["q"], 64); err == nil && q <= 0 {
				continue
			}
			return true
		}
	}
	return false
}

type readCloser struct {
	io.Reader
	io.Closer
}

// firstByte is the first byte of the body that is not JSON whitespace ('['
// opens a JSON-RPC batch), without consuming it; 0 if there is none within
// the reader's buffer.
func firstByte(r *bufio.Reader) byte {
	for n := 1; n <= r.Size(); n++ {
		b, err := r.Peek(n)
		if err != nil {
			return 0
		}
		switch c := b[n-1]; c {
		case ' ', '\t', '\r', '\n':
		default:
			return c
		}
	}
	return 0
}

// jsonWriter collects the SDK's SSE answer to a POST and writes it out as
// JSON when the handler is done. Any other answer (202 for notifications,
// the SDK's errors) passes through unchanged.
type jsonWriter struct {
	w     http.ResponseWriter
	batch bool // the request was a batch: answer an array

	decided bool // WriteHeader happened
	collect bool // the answer is an SSE stream, collected in buf
	buf     bytes.Buffer
}

func (j *jsonWriter) Header() http.Header { return j.w.Header() }

func (j *jsonWriter) WriteHeader(code int) {
	if j.decided {
		return
	}
	j.decided = true
	mt, _, _ := mime.ParseMediaType(j.w.Header().Get("Content-Type"))
	if code == http.StatusOK && mt == "text/event-stream" {
		j.collect = true
		return
	}
	j.w.WriteHeader(code)
}

func (j *jsonWriter) Write(p []byte) (int, error) {
	if !j.decided {
		j.WriteHeader(http.StatusOK)
	}
	if j.collect {
		return j.buf.Write(p)
	}
	return j.w.Write(p)
}

// Flush is the SDK's after every event: nothing to do while collecting.
func (j *jsonWriter) Flush() {
	if j.collect {
		return
	}
	if f, ok := j.w.(http.Flusher); ok {
		f.Flush()
	}
}

// finish writes the collected responses: the one response, or an array of
// them for a batch.
func (j *jsonWriter) finish() {
	if !j.collect {
		return
	}
	var responses []json.RawMessage
	for _, data := range sseData(j.buf.Bytes()) {
		if isResponse(data) {
			responses = append(responses, data)
		}
	}
	h := j.w.Header()
	h.Del("Connection")
	if len(responses) == 0 { // the session ended before the call was answered
		h.Del("Content-Type")
		http.Error(j.w, "the MCP session closed before the request was answered", http.StatusServiceUnavailable)
		return
	}
	body := []byte(responses[0])
	if j.batch || len(responses) > 1 {
		body, _ = json.Marshal(responses) // RawMessages that parsed: cannot fail
	}
	h.Set("Content-Type", "application/json")
	h.Set("Content-Length", strconv.Itoa(len(body)))
	j.w.WriteHeader(http.StatusOK)
	_, _ = j.w.Write(body)
}

// sseData is the data of each event in an SSE stream (the SDK writes one
// "data:" line per event; several are joined with newlines, as the SSE
// format says).
func sseData(stream []byte) [][]byte {
	var out [][]byte
	var data []byte
	has := false
	for line := range bytes.SplitSeq(stream, []byte("\n")) {
		line = bytes.TrimSuffix(line, []byte("\r"))
		if len(line) == 0 {
			if has {
				out = append(out, data)
			}
			data, has = nil, false
			continue
		}
		v, ok := bytes.CutPrefix(line, []byte("data:"))
		if !ok {
			continue
		}
		v = bytes.TrimPrefix(v, []byte(" "))
		if has {
			data = append(data, '\n')
		}
		data = append(data, v...)
		has = true
	}
	if has {
		out = append(out, data)
	}
	return out
}

// isResponse reports whether a JSON-RPC message is a response (it has an
// id, and a result or an error, and no method).
func isResponse(msg []byte) bool {
	var m struct {
		ID     json.RawMessage `json:"id"`
		Method *string         `json:"method"`
		Result json.RawMessage `json:"result"`
		Error  json.RawMessage `json:"error"`
	}
	if err := json.Unmarshal(msg, &m); err != nil {
		return false
	}
	return m.Method == nil && len(m.ID) > 0 && (m.Result != nil || m.Error != nil)
}
