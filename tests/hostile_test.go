package tests

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/tests/cluster"
)

// maxBody is the contract's REST body limit (§1.1).
const maxBody = 8 << 20

// hostileReply is one response read off the wire.
type hostileReply struct {
	status int
	header http.Header
	body   []byte
}

// rawDo writes one HTTP/1.1 request exactly as given (request-target
// included: no client cleans or re-encodes it) and reads the response.
// chunked sends the body without a Content-Length.
func rawDo(t *testing.T, addr, method, target string, body []byte, chunked bool) hostileReply {
	t.Helper()
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(60 * time.Second))
	var hdr bytes.Buffer
	fmt.Fprintf(&hdr, "%s %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n", method, target, addr)
	if body != nil {
		hdr.WriteString("Content-Type: application/json\r\n")
		if chunked {
			hdr.WriteString("Transfer-Encoding: chunked\r\n")
		} else {
			fmt.Fprintf(&hdr, "Content-Length: %d\r\n", len(body))
		}
	}
	hdr.WriteString("\r\n")
	// The server may answer and close before it read the whole body (an
	// oversized one): a write error then is not the test's failure.
	go func() {
		w := bufio.NewWriterSize(conn, 64<<10)
		w.Write(hdr.Bytes())
		switch {
		case body == nil:
		case chunked:
			for b := body; len(b) > 0; {
				n := min(len(b), 1<<20)
				fmt.Fprintf(w, "%x\r\n", n)
				w.Write(b[:n])
				w.WriteString("\r\n")
				b = b[n:]
			}
			w.WriteString("0\r\n\r\n")
		default:
			w.Write(body)
		}
		w.Flush()
	}()
	resp, err := http.ReadResponse(bufio.NewReader(conn), &http.Request{Method: method})
	if err != nil {
		t.Fatalf("%s %.80s: %v", method, target, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return hostileReply{resp.StatusCode, resp.Header, b}
}

// expectEnvelope checks a response is the error envelope with one of the
// allowed status/code pairs and returns the code.
func expectEnvelope(t *testing.T, what string, r hostileReply, allowed ...any) apierr.Code {
	t.Helper()
	var e envelope
	dec := json.NewDecoder(bytes.NewReader(r.body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&e); err != nil || r.header.Get("Content-Type") != "application/json" {
		t.Fatalf("%s: %d, not the error envelope (%v): %.200q", what, r.status, err, r.body)
	}
	for i := 0; i+1 < len(allowed); i += 2 {
		if r.status == allowed[i].(int) && e.Error.Code == string(allowed[i+1].(apierr.Code)) && e.Error.Message != "" {
			t.Logf("%.60s → %d %s: %.120s", what, r.status, e.Error.Code, e.Error.Message)
			return apierr.Code(e.Error.Code)
		}
	}
	t.Fatalf("%s: %d %s %.200q, want one of %v", what, r.status, e.Error.Code, e.Error.Message, allowed)
	return ""
}

// TestHostile sends malformed, oversized and path-traversing requests to the
// REST API of an in-process cluster (no VM boots). Every one is refused with
// the contract's status and a stable code; afterwards the gateway is still
// ready and nothing was created. The IMDS's sysupdate traversal cases are
// unit tests (internal/imds, internal/vm): the IMDS only answers inside a
// network's userspace stack, to a VM's lease address.
func TestHostile(t *testing.T) {
	images := t.TempDir()
	writeCatalog(t, images)
	c := cluster.Start(t, cluster.InProcess, binDir, cluster.Options{ImageDir: images})
	api := "http://" + c.Addr + "/api/v1"

	var policiesBefore []byte
	{
		_, _, policiesBefore = cluster.Do(t, "GET", api+"/policies", "")
	}
	ready := func(t *testing.T) {
		t.Helper()
		if err := cluster.Readyz(c.Addr); err != nil {
			t.Fatalf("/readyz after the case: %v", err)
		}
	}
	post := func(t *testing.T, path string, body []byte, allowed ...any) apierr.Code {
		t.Helper()
		what := fmt.Sprintf("POST /api/v1%s %.40q (%d bytes)", path, body, len(body))
		code := expectEnvelope(t, what, rawDo(t, c.Addr, "POST", "/api/v1"+path, body, false), allowed...)
		ready(t)
		return code
	}
	bad := []any{400, apierr.InvalidRequest}

	t.Run("oversized body", func(t *testing.T) {
		vm := func(n int) []byte { // a create_vm body of exactly n bytes
			head, tail := `{"name":"big","require_attestation":false,"user_data":"`, `"}`
			return []byte(head + strings.Repeat("x", n-len(head)-len(tail)) + tail)
		}
		for _, chunked := range []bool{false, true} {
			r := rawDo(t, c.Addr, "POST", "/api/v1/vms", vm(maxBody+1), chunked)
			expectEnvelope(t, fmt.Sprintf("8 MiB + 1 (chunked %t)", chunked), r, bad...)
			ready(t)
		}
		r := rawDo(t, c.Addr, "POST", "/api/v1/vms", vm(64<<20), true)
		expectEnvelope(t, "64 MiB chunked", r, bad...)
		ready(t)
		net := `{"name":"big","cidr":"10.9.0.0/24","dns_search_domain":"` + strings.Repeat("a", maxBody) + `"}`
		post(t, "/networks", []byte(net), bad...)
		// At the limit the body is read and the request judged on its merits.
		atLimit := vm(maxBody)
		atLimit = bytes.Replace(atLimit, []byte(`"big"`), []byte(`"BIG"`), 1)
		r = rawDo(t, c.Addr, "POST", "/api/v1/vms", atLimit, false)
		var e envelope
		if json.Unmarshal(r.body, &e) != nil || r.status != 400 || !strings.Contains(e.Error.Message, "DNS label") {
			t.Errorf("a body of exactly 8 MiB: %d %.200q, want the name's validation error", r.status, r.body)
		}
	})

	t.Run("deeply nested JSON", func(t *testing.T) {
		for _, body := range []string{
			strings.Repeat("[", 100000),
			strings.Repeat("[", 100000) + strings.Repeat("]", 100000),
			strings.Repeat(`{"a":`, 100000),
			`{"name":"x","metadata":` + strings.Repeat(`{"a":`, 100000),
			`{"name":"x","ssh_authorized_keys":` + strings.Repeat("[", 100000),
		} {
			post(t, "/vms", []byte(body), bad...)
		}
		post(t, "/networks", []byte(`{"name":"n","cidr":"10.9.0.0/24","egress":`+strings.Repeat("[", 100000)), bad...)
		post(t, "/networks", []byte(`{"name":"n","cidr":"10.9.0.0/24","egress":[`+strings.Repeat(`{"cidr":`, 100000)), bad...)
	})

	t.Run("invalid UTF-8", func(t *testing.T) {
		for _, body := range []string{
			"{\"name\":\"a\xff\",\"require_attestation\":false}",
			"{\"name\":\"a\",\"hostname\":\"\xc3\x28\",\"require_attestation\":false}",
			"{\"name\":\"a\",\"metadata\":{\"role\":\"\xed\xa0\x80\"},\"require_attestation\":false}",
			"{\"name\":\"a\",\"metadata\":{\"\xfe\":\"x\"},\"require_attestation\":false}",
			"{\"name\":\"a\",\"user_data\":\"\x80\",\"require_attestation\":false}",
		} {
			post(t, "/vms", []byte(body), bad...)
		}
		post(t, "/networks", []byte("{\"name\":\"n\xff\",\"cidr\":\"10.9.0.0/24\"}"), bad...)
		post(t, "/networks", []byte("{\"name\":\"n\",\"cidr\":\"10.9.0.0/24\",\"dns_search_domain\":\"a\xffb\"}"), bad...)
	})

	t.Run("path traversal in image refs", func(t *testing.T) {
		notFoundOrBad := []any{400, apierr.InvalidRequest, 404, apierr.NotFound}
		for _, ref := range []string{
			"..%2F..%2Fetc",
			"..%2F..%2F..%2Fetc%2Fpasswd",
			"%2e%2e%2f%2e%2e%2fetc",
			"%2E%2E%2F%2E%2E%2Fetc",
			"..%252F..%252Fetc",
			"..%5C..%5Cetc",
			"..",
			"%2e%2e",
			"../../etc/passwd",
			"../../../../etc/passwd",
			"giantswarm-vm-base_0.2.0/../../../etc",
			"giantswarm-vm-base_0.2.0%2F..%2F..",
			"%2Fetc%2Fpasswd",
			"/etc/passwd",
			"x%00",
			strings.Repeat("a", 100000),
		} {
			r := rawDo(t, c.Addr, "GET", "/api/v1/images/"+ref, nil, false)
			expectEnvelope(t, "GET /api/v1/images/"+ref, r, notFoundOrBad...)
			ready(t)
			r = rawDo(t, c.Addr, "PUT", "/api/v1/images/"+ref+"/policy", []byte(`{"golden":{"sha256":{"0":"`+strings.Repeat("0", 64)+`"}}}`), false)
			expectEnvelope(t, "PUT /api/v1/images/"+ref+"/policy", r, notFoundOrBad...)
			ready(t)
		}
		for _, ref := range []string{"../../etc/passwd", "..", "/etc/passwd", "giantswarm-vm-base_0.2.0/..", `..\..\etc`} {
			post(t, "/vms", []byte(`{"name":"t","require_attestation":false,"image":`+strconv.Quote(ref)+`}`), bad...)
		}
	})

	t.Run("hostile metadata keys", func(t *testing.T) {
		for _, key := range []string{"a/b", "/", "../..", "..", ".", "a\u0000b", "\u0000", "a b", "a\tb", "a\nb", "a\rb", "a\u007fb", "", strings.Repeat("k", 129)} {
			body, _ := json.Marshal(map[string]any{"name": "t", "require_attestation": false, "metadata": map[string]string{key: "v"}})
			post(t, "/vms", body, bad...)
		}
	})

	t.Run("huge metadata and long names", func(t *testing.T) {
		var b strings.Builder
		b.WriteString(`{"name":"t","require_attestation":false,"metadata":{`)
		for i := range 300000 { // ~4.5 MB, under the body limit
			if i > 0 {
				b.WriteByte(',')
			}
			fmt.Fprintf(&b, `"k%d":"v"`, i)
		}
		b.WriteString(`}}`)
		post(t, "/vms", []byte(b.String()), bad...)
		post(t, "/vms", []byte(`{"name":"t","require_attestation":false,"metadata":{"a":"`+strings.Repeat("v", 300<<10)+`"}}`), bad...)
		long := strings.Repeat("a", 1<<20)
		post(t, "/vms", []byte(`{"name":"`+long+`","require_attestation":false}`), bad...)
		post(t, "/vms", []byte(`{"name":"t","hostname":"`+long+`","require_attestation":false}`), bad...)
		post(t, "/vms", []byte(`{"name":"t","image":"`+long+`","require_attestation":false}`), bad...)
		post(t, "/vms", []byte(`{"name":"t","network":"`+long+`","require_attestation":false}`), bad...)
		post(t, "/vms", []byte(`{"name":"t","kubernetes_version":"`+long+`","require_attestation":false}`), bad...)
		post(t, "/networks", []byte(`{"name":"`+long+`","cidr":"10.9.0.0/24"}`), bad...)
		post(t, "/networks", []byte(`{"name":"n","cidr":"10.9.0.0/24","dns_search_domain":"`+long+`"}`), bad...)
		var rules strings.Builder
		for i := range 10000 {
			if i > 0 {
				rules.WriteByte(',')
			}
			fmt.Fprintf(&rules, `{"cidr":"10.%d.%d.0/24","ports":[443]}`, i/256, i%256)
		}
		post(t, "/networks", []byte(`{"name":"n","cidr":"10.9.0.0/24","egress":[`+rules.String()+`]}`), bad...)
		r := rawDo(t, c.Addr, "GET", "/api/v1/vms/"+long, nil, false)
		expectEnvelope(t, "GET /vms/<1 MiB id>", r, 404, apierr.NotFound, 400, apierr.InvalidRequest)
		ready(t)
	})

	t.Run("nothing was created", func(t *testing.T) {
		code, _, b := cluster.Do(t, "GET", api+"/vms", "")
		if code != 200 || strings.TrimSpace(string(b)) != "[]" {
			t.Errorf("vms after the hostile requests: %d %s", code, b)
		}
		var nets []struct{ Spec struct{ Name string } }
		getJSON(t, api+"/networks", &nets)
		if len(nets) != 1 || nets[0].Spec.Name != "default" {
			t.Errorf("networks after the hostile requests: %+v", nets)
		}
		if _, _, after := cluster.Do(t, "GET", api+"/policies", ""); !bytes.Equal(after, policiesBefore) {
			t.Errorf("policies changed:\n%s\n%s", policiesBefore, after)
		}
		if ents, err := os.ReadDir(filepath.Join(c.StateDir, "vms")); err == nil && len(ents) > 0 {
			t.Errorf("VM directories were created: %v", ents)
		}
		for _, p := range []string{filepath.Join(c.Dir, "etc"), filepath.Join(c.StateDir, "etc")} {
			if _, err := os.Stat(p); err == nil {
				t.Errorf("%s exists", p)
			}
		}
	})
}
