package connsplit

import (
	"bytes"
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"os"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/pkg/poll"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// servers runs a gRPC server (health) and an HTTP server saying which one
// answered on one split listener.
func servers(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := New(ln)
	gs := grpc.NewServer()
	healthpb.RegisterHealthServer(gs, health.NewServer())
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	hs := &http.Server{Protocols: &p, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "http "+r.Proto)
	})}
	go func() { _ = gs.Serve(s.GRPC) }()
	go func() { _ = hs.Serve(s.HTTP) }()
	t.Cleanup(func() { gs.Stop(); hs.Close(); s.Close() })
	return ln.Addr().String()
}

func get(t *testing.T, c *http.Client, url string) string {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

func TestSplit(t *testing.T) {
	addr := servers(t)

	t.Run("gRPC goes to the gRPC server", func(t *testing.T) {
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			t.Fatalf("health: %v %v", resp, err)
		}
	})
	t.Run("HTTP/1.1, short requests included", func(t *testing.T) {
		if got := get(t, &http.Client{}, "http://"+addr+"/"); got != "http HTTP/1.1" {
			t.Errorf("got %q", got)
		}
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_, _ = io.WriteString(c, "GET / HTTP/1.0\r\n\r\n") // shorter than the preface
		b, _ := io.ReadAll(c)
		if !bytes.HasSuffix(b, []byte("http HTTP/1.0")) {
			t.Errorf("got %q", b)
		}
	})
	t.Run("REST over h2c prior knowledge goes to the HTTP server", func(t *testing.T) {
		h2c := &http.Client{Transport: &http2.Transport{AllowHTTP: true, DialTLSContext: func(ctx context.Context, network, addr string, _ *tls.Config) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		}}}
		if got := get(t, h2c, "http://"+addr+"/"); got != "http HTTP/2.0" {
			t.Errorf("got %q", got)
		}
	})
}

func TestClassify(t *testing.T) {
	headers := func(contentType string, ack ...bool) []byte {
		var hb bytes.Buffer
		enc := hpack.NewEncoder(&hb)
		for _, f := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":path", "/a.B/C"}, {":authority", "x"}, {"content-type", contentType}} {
			_ = enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
		}
		var buf bytes.Buffer
		buf.WriteString(preface)
		fr := http2.NewFramer(&buf, nil)
		_ = fr.WriteSettings()
		if len(ack) > 0 {
			_ = fr.WriteSettingsAck()
		}
		_ = fr.WriteWindowUpdate(0, 1<<20)
		_ = fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true})
		return buf.Bytes()
	}
	withoutAck := headers("application/grpc") // what the server gets of the one with the ACK
	for _, tc := range []struct {
		name       string
		sent, want []byte
		grpc       bool
	}{
		{"grpc", headers("application/grpc"), nil, true},
		{"the ACK of sniff's SETTINGS is dropped", headers("application/grpc", true), withoutAck, true},
		{"grpc+proto", headers("application/grpc+proto"), nil, true},
		{"json over h2c", headers("application/json"), nil, false},
		{"grpc-web is not gRPC", headers("application/grpc-web"), nil, false},
		{"preface, then waiting", []byte(preface), nil, true},
		{"HTTP/1", []byte("POST / HTTP/1.1\r\nHost: x\r\n\r\n"), nil, false},
		{"garbage", []byte("PRI * HTTP/1.1\r\n"), nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			client, server := net.Pipe()
			defer client.Close()
			go func() { _, _ = client.Write(tc.sent) }()
			fromServer := make(chan []byte, 1)
			go func() { b, _ := io.ReadAll(client); fromServer <- b }()
			conn, grpc := classify(server)
			if grpc != tc.grpc {
				t.Errorf("gRPC %v, want %v", grpc, tc.grpc)
			}
			// What was read comes first, byte for byte.
			want := tc.sent
			if tc.want != nil {
				want = tc.want
			}
			got := make([]byte, len(want))
			_ = conn.SetReadDeadline(time.Now().Add(time.Second))
			if _, err := io.ReadFull(conn, got); err != nil || !bytes.Equal(got, want) {
				t.Errorf("replayed %q (%v), want %q", got, err, want)
			}
			// An HTTP/2 client got an empty SETTINGS frame, nothing else.
			conn.Close()
			wantSettings := []byte(nil)
			if bytes.HasPrefix(tc.sent, []byte(preface)) {
				wantSettings = settings
			}
			if b := <-fromServer; !bytes.Equal(b, wantSettings) {
				t.Errorf("the client got %q, want %q", b, wantSettings)
			}
		})
	}
}

// TestCloseDoesNotWaitForSilentClients: a connection that has sent nothing
// yet is closed with the split instead of holding Close for PrefaceWait.
func TestCloseDoesNotWaitForSilentClients(t *testing.T) {
	defer func(d time.Duration) { PrefaceWait = d }(PrefaceWait)
	PrefaceWait = time.Hour // Close would wait for it
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := New(ln)
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// The split has the connection once it is being classified.
	poll.Until(t, "the connection to be classified", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return len(s.pending) == 1
	})
	_ = s.Close()
	_ = c.SetReadDeadline(time.Now().Add(poll.Bound))
	if _, err := c.Read(make([]byte, 1)); err == nil || os.IsTimeout(err) {
		t.Errorf("the silent connection is still open after Close: %v", err)
	}
}
