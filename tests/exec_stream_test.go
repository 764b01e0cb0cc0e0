package tests

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/creack/pty"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/identity/oidctest"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/sdk/client"
	"github.com/giantswarm/vm-manager/tests/cluster"
)

// TestExecStream runs streamed exec sessions in a real guest through the
// three binaries: a shell on a pty (stdin, resize, ^C, exit code), a signal,
// stdin to EOF, output larger than the unary exec's cap complete and in
// order, the WebSocket form, and the SDK example attached to a pty.
func TestExecStream(t *testing.T) {
	images := cluster.GuestImages(t, "..")
	// Small bounds, so that the test reaches them: two sessions at once,
	// 8 s without input or output.
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, Env: []string{
		"VM_MANAGER_MAX_EXEC_SESSIONS=2", "VM_MANAGER_EXEC_IDLE_TIMEOUT=8s",
	}})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })
	vm := a.vm("POST", "/vms", `{"name":"ex1","image":"test-guest","require_attestation":false,"memory_mib":512,"cpus":1}`, 201)
	if vm.State != "ready" {
		t.Fatalf("created vm %+v", vm)
	}
	cl, err := client.Dial(c.Addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })

	t.Run("pty", func(t *testing.T) {
		s := openExec(t, cl, &hypervisorv1.ExecStart{Id: vm.ID, Command: []string{"sh"}, Pty: &hypervisorv1.ExecPty{Term: "xterm", Rows: 24, Cols: 80}})
		s.stdin("stty size; echo TERM=$TERM\n")
		s.waitOut("24 80\r\nTERM=xterm")
		s.send(&hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_Resize{Resize: &hypervisorv1.ExecWindowSize{Rows: 40, Cols: 100}}})
		s.stdin("stty size\n")
		s.waitOut("40 100")
		// A terminal merges stderr into stdout.
		s.stdin("echo to-stderr >&2\n")
		s.waitOut("to-stderr\r\n")
		// ^C (typed, as a terminal does) interrupts the foreground job.
		s.stdin("echo sleeping; sleep 1000\n")
		s.waitOut("sleeping\r\n")
		time.Sleep(500 * time.Millisecond)
		s.stdin("\x03")
		s.stdin("echo status-$?\n")
		s.waitOut("status-130")
		s.stdin("exit 3\n")
		if exit := s.wait(); exit.GetExitCode() != 3 || exit.GetSignal() != "" {
			t.Fatalf("exit %v, want 3", exit)
		}
		if s.errBuf.Len() != 0 {
			t.Errorf("stderr under a pty: %q", s.errBuf.String())
		}
	})

	t.Run("signal", func(t *testing.T) {
		s := openExec(t, cl, &hypervisorv1.ExecStart{Id: vm.ID, Command: []string{"sh", "-c", "echo started; sleep 1000"}})
		s.waitOut("started\n")
		s.send(&hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_Signal{Signal: "TERM"}})
		if exit := s.wait(); exit.GetSignal() != "TERM" || exit.GetExitCode() != 143 {
			t.Fatalf("exit %v, want TERM (143)", exit)
		}
	})

	t.Run("stdin and env", func(t *testing.T) {
		s := openExec(t, cl, &hypervisorv1.ExecStart{Id: vm.ID, Command: []string{"sh", "-c", `cat; echo "$GREETING" >&2; exit 4`}, Env: map[string]string{"GREETING": "hi there"}})
		s.stdin("line 1\n")
		s.stdin("line 2\n")
		s.send(&hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_StdinClose{StdinClose: &hypervisorv1.ExecStdinClose{}}})
		if exit := s.wait(); exit.GetExitCode() != 4 || s.out() != "line 1\nline 2\n" || s.errBuf.String() != "hi there\n" {
			t.Fatalf("exit %v, stdout %q, stderr %q", exit, s.out(), s.errBuf.String())
		}
	})

	t.Run("large output", func(t *testing.T) {
		// ~2.7 MB on stdout, more than the unary exec keeps (1 MiB), and
		// some stderr alongside; the reader starts late.
		const n = 400000
		s := openExec(t, cl, &hypervisorv1.ExecStart{Id: vm.ID, Command: []string{"sh", "-c", "seq 1 " + strconv.Itoa(n) + "; seq 1 1000 >&2"}})
		began := time.Now()
		time.Sleep(2 * time.Second)
		exit := s.wait()
		t.Logf("streamed %d bytes in %s (the reader starting 2 s late)", len(s.out()), time.Since(began).Round(time.Millisecond))
		var want bytes.Buffer
		for i := 1; i <= n; i++ {
			want.WriteString(strconv.Itoa(i) + "\n")
		}
		if exit.GetExitCode() != 0 || s.out() != want.String() {
			t.Fatalf("exit %v; stdout %d bytes, want %d; equal %v", exit, len(s.out()), want.Len(), s.out() == want.String())
		}
		if want.Len() <= 1<<20 {
			t.Fatalf("the test's output (%d) is within the unary cap", want.Len())
		}
		if !strings.HasSuffix(s.errBuf.String(), "999\n1000\n") {
			t.Errorf("stderr tail %q", s.errBuf.String()[max(0, s.errBuf.Len()-20):])
		}
	})

	t.Run("refusals", func(t *testing.T) {
		for name, st := range map[string]*hypervisorv1.ExecStart{
			"unknown vm": {Id: "ffffffff", Command: []string{"true"}},
			"bad env":    {Id: vm.ID, Command: []string{"true"}, Env: map[string]string{"A=B": "c"}},
			"bad pty":    {Id: vm.ID, Pty: &hypervisorv1.ExecPty{Rows: 1 << 20}},
		} {
			stream, err := cl.Hypervisor.ExecVirtualMachineStream(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			_ = stream.Send(&hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_Start{Start: st}})
			_, err = stream.Recv()
			want := apierr.InvalidRequest
			if name == "unknown vm" {
				want = apierr.NotFound
			}
			if apierr.CodeOf(err) != want {
				t.Errorf("%s: %v, want %s", name, err, want)
			}
		}
	})

	t.Run("bounds", func(t *testing.T) {
		var held []*execSession
		for range 2 {
			s := openExec(t, cl, &hypervisorv1.ExecStart{Id: vm.ID, Command: []string{"sh", "-c", "echo started; sleep 1000"}})
			s.waitOut("started\n")
			held = append(held, s)
		}
		third := openExec(t, cl, &hypervisorv1.ExecStart{Id: vm.ID, Command: []string{"true"}})
		<-third.exit
		if apierr.CodeOf(third.err) != apierr.ResourceExhausted {
			t.Fatalf("a third session: %v, want resource_exhausted", third.err)
		}
		// Silent for --exec-idle-timeout: ended, with a timeout.
		for _, s := range held {
			select {
			case <-s.exit:
			case <-time.After(2 * time.Minute):
				t.Fatal("an idle session was not ended")
			}
			if apierr.CodeOf(s.err) != apierr.Timeout || !strings.Contains(s.err.Error(), "--exec-idle-timeout") {
				t.Errorf("idle session: %v, want timeout", s.err)
			}
		}
	})

	t.Run("websocket", func(t *testing.T) {
		execWebSocket(t, c.Addr, vm.ID)
	})

	// grpcurl through the gateway (reflection), as docs/api.md shows it:
	// requests on stdin, its end is stdin's end; bytes are base64 in JSON.
	t.Run("grpcurl", func(t *testing.T) {
		grpcurl := requireGrpcurl(t)
		cmd := exec.Command(grpcurl, "-plaintext", "-d", "@", c.Addr, "vmmanager.hypervisor.v1.HypervisorService/ExecVirtualMachineStream")
		cmd.Stdin = strings.NewReader(`{"start":{"id":"` + vm.ID + `","command":["sh","-c","cat; exit 2"]}}
{"stdin":"` + base64.StdEncoding.EncodeToString([]byte("via grpcurl\n")) + `"}
`)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("grpcurl: %v\n%s", err, out)
		}
		for _, want := range []string{`"stdout": "` + base64.StdEncoding.EncodeToString([]byte("via grpcurl\n")) + `"`, `"exitCode": 2`} {
			if !strings.Contains(string(out), want) {
				t.Errorf("grpcurl output lacks %s:\n%s", want, out)
			}
		}
	})

	t.Run("example", func(t *testing.T) {
		shellExample(t, c.Addr, vm.ID)
	})

	// Every session above ended and was counted.
	var m string
	cluster.Eventually(t, 10*time.Second, "exec session counters", func() error {
		_, _, b := cluster.Do(t, "GET", "http://"+c.Addr+"/metrics", "")
		m = string(b)
		if !strings.Contains(m, "vm_manager_exec_sessions 0") {
			return errors.New("sessions still open")
		}
		return nil
	})
	a.vm("DELETE", "/vms/"+vm.ID, "", 204)
	for _, want := range []string{`vm_manager_exec_sessions_ended_total{reason="idle_timeout"} 2`, "vm_manager_exec_sessions_refused_total 1", `vm_manager_exec_sessions_ended_total{reason="exit"}`} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %s", want)
		}
	}
}

// execSession is a gRPC exec stream with its output collected.
type execSession struct {
	t      *testing.T
	stream hypervisorv1.HypervisorService_ExecVirtualMachineStreamClient
	mu     sync.Mutex
	outBuf bytes.Buffer
	errBuf bytes.Buffer
	exit   chan *hypervisorv1.ExecExit
	err    error
}

func openExec(t *testing.T, cl *client.Client, st *hypervisorv1.ExecStart) *execSession {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	stream, err := cl.Hypervisor.ExecVirtualMachineStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	s := &execSession{t: t, stream: stream, exit: make(chan *hypervisorv1.ExecExit, 1)}
	s.send(&hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_Start{Start: st}})
	go func() {
		defer close(s.exit)
		for {
			resp, err := stream.Recv()
			if err != nil {
				s.mu.Lock()
				s.err = err
				s.mu.Unlock()
				return
			}
			s.mu.Lock()
			switch k := resp.GetKind().(type) {
			case *hypervisorv1.ExecVirtualMachineStreamResponse_Stdout:
				s.outBuf.Write(k.Stdout)
			case *hypervisorv1.ExecVirtualMachineStreamResponse_Stderr:
				s.errBuf.Write(k.Stderr)
			case *hypervisorv1.ExecVirtualMachineStreamResponse_Exit:
				s.exit <- k.Exit
			}
			s.mu.Unlock()
		}
	}()
	return s
}

func (s *execSession) send(req *hypervisorv1.ExecVirtualMachineStreamRequest) {
	s.t.Helper()
	if err := s.stream.Send(req); err != nil {
		s.t.Fatalf("send: %v", err)
	}
}

func (s *execSession) stdin(text string) {
	s.t.Helper()
	s.send(&hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_Stdin{Stdin: []byte(text)}})
}

func (s *execSession) out() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.outBuf.String()
}

func (s *execSession) waitOut(want string) {
	s.t.Helper()
	cluster.Eventually(s.t, time.Minute, "output "+strconv.Quote(want), func() error {
		if !strings.Contains(s.out(), want) {
			return errors.New("output so far: " + strconv.Quote(s.out()))
		}
		return nil
	})
}

// wait returns the exit message, which comes after all output.
func (s *execSession) wait() *hypervisorv1.ExecExit {
	s.t.Helper()
	select {
	case exit, ok := <-s.exit:
		if !ok {
			s.mu.Lock()
			defer s.mu.Unlock()
			s.t.Fatalf("stream ended without an exit: %v", s.err)
		}
		<-s.exit // the stream's end: all output is in
		return exit
	case <-time.After(3 * time.Minute):
		s.t.Fatal("no exit")
	}
	return nil
}

// execWebSocket drives the WebSocket form: JSON start, binary stdin, a
// stdinClose request; stream-prefixed output, the exit last. And what the
// endpoint refuses: a plain GET, no subprotocol, a cross-site page.
func execWebSocket(t *testing.T, addr, id string) {
	url := "ws://" + addr + "/api/v1/vms/" + id + "/exec/ws"
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, _, err := websocket.Dial(ctx, url, &websocket.DialOptions{Subprotocols: []string{"vmm.exec.v1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.CloseNow()
	if c.Subprotocol() != "vmm.exec.v1" {
		t.Fatalf("subprotocol %q", c.Subprotocol())
	}
	write := func(typ websocket.MessageType, s string) {
		t.Helper()
		if err := c.Write(ctx, typ, []byte(s)); err != nil {
			t.Fatal(err)
		}
	}
	write(websocket.MessageText, `{"start":{"command":["sh","-c","cat; echo err >&2; exit 4"]}}`)
	write(websocket.MessageBinary, "ws-in\n")
	write(websocket.MessageText, `{"stdinClose":{}}`)
	var stdout, stderr bytes.Buffer
	var exit struct {
		Exit *struct {
			ExitCode *int   `json:"exitCode"`
			Signal   string `json:"signal"`
		} `json:"exit"`
	}
	for exit.Exit == nil {
		typ, data, err := c.Read(ctx)
		if err != nil {
			t.Fatalf("read: %v (stdout %q stderr %q)", err, stdout.String(), stderr.String())
		}
		switch {
		case typ == websocket.MessageBinary && len(data) > 0 && data[0] == 1:
			stdout.Write(data[1:])
		case typ == websocket.MessageBinary && len(data) > 0 && data[0] == 2:
			stderr.Write(data[1:])
		case typ == websocket.MessageText:
			if err := json.Unmarshal(data, &exit); err != nil || exit.Exit == nil {
				t.Fatalf("text message %s: %v", data, err)
			}
		default:
			t.Fatalf("message %v %q", typ, data)
		}
	}
	if exit.Exit.ExitCode == nil || *exit.Exit.ExitCode != 4 || stdout.String() != "ws-in\n" || stderr.String() != "err\n" {
		t.Fatalf("exit %+v stdout %q stderr %q", exit.Exit, stdout.String(), stderr.String())
	}
	if _, _, err := c.Read(ctx); websocket.CloseStatus(err) != websocket.StatusNormalClosure {
		t.Errorf("after the exit: %v, want a normal close", err)
	}

	// A pty over the WebSocket: resize and signal as JSON requests.
	wsPty(t, ctx, url)

	// An error comes as the REST envelope, then the close.
	c2, _, err := websocket.Dial(ctx, "ws://"+addr+"/api/v1/vms/ffffffff/exec/ws", &websocket.DialOptions{Subprotocols: []string{"vmm.exec.v1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c2.CloseNow()
	_ = c2.Write(ctx, websocket.MessageText, []byte(`{"start":{"command":["true"]}}`))
	if _, data, err := c2.Read(ctx); err != nil || !strings.Contains(string(data), `"code": "not_found"`) {
		t.Errorf("unknown vm: %s %v", data, err)
	}

	// Refused before the upgrade.
	if code, _, b := cluster.Do(t, "GET", "http://"+addr+"/api/v1/vms/"+id+"/exec/ws", ""); code != http.StatusUpgradeRequired {
		t.Errorf("plain GET: %d %s", code, b)
	}
	if _, resp, err := websocket.Dial(ctx, url, nil); err == nil || resp == nil || resp.StatusCode != http.StatusBadRequest {
		t.Errorf("no subprotocol: %v %v", resp, err)
	}
	// A page elsewhere opening the socket in the operator's browser: the
	// anonymous gateway refuses its Origin (xsite), before the upgrade.
	_, resp, err := websocket.Dial(ctx, url, &websocket.DialOptions{
		Subprotocols: []string{"vmm.exec.v1"},
		HTTPHeader:   http.Header{"Origin": {"http://evil.example"}},
	})
	if err == nil || resp == nil || resp.StatusCode != http.StatusForbidden {
		t.Fatalf("cross-site Origin: %v %v, want 403", resp, err)
	}
}

// wsPty runs sh on a pty over the WebSocket: its size, a resize, then KILL
// for the shell's process group.
func wsPty(t *testing.T, ctx context.Context, url string) {
	c, _, err := websocket.Dial(ctx, url, &websocket.DialOptions{Subprotocols: []string{"vmm.exec.v1"}})
	if err != nil {
		t.Fatal(err)
	}
	defer c.CloseNow()
	var out bytes.Buffer
	var exitMsg []byte
	// readUntil reads until the output has want, or with want "" until the
	// text message that ends the session.
	readUntil := func(want string) {
		t.Helper()
		for want == "" || !strings.Contains(out.String(), want) {
			typ, data, err := c.Read(ctx)
			if err != nil {
				t.Fatalf("read: %v; output %q", err, out.String())
			}
			if typ == websocket.MessageText {
				exitMsg = data
				if want == "" {
					return
				}
				t.Fatalf("text message %s before %q", data, want)
			}
			if data[0] != 1 {
				t.Fatalf("stream %d under a pty", data[0])
			}
			out.Write(data[1:])
		}
	}
	for _, m := range []struct {
		typ websocket.MessageType
		msg string
	}{
		{websocket.MessageText, `{"start":{"command":["sh"],"pty":{"term":"xterm","rows":24,"cols":80}}}`},
		{websocket.MessageBinary, "stty size\n"},
	} {
		if err := c.Write(ctx, m.typ, []byte(m.msg)); err != nil {
			t.Fatal(err)
		}
	}
	readUntil("24 80")
	_ = c.Write(ctx, websocket.MessageText, []byte(`{"resize":{"rows":33,"cols":99}}`))
	_ = c.Write(ctx, websocket.MessageBinary, []byte("stty size\n"))
	readUntil("33 99")
	_ = c.Write(ctx, websocket.MessageText, []byte(`{"signal":"KILL"}`))
	readUntil("")
	if !strings.Contains(string(exitMsg), `"exitCode":137`) || !strings.Contains(string(exitMsg), `"signal":"KILL"`) {
		t.Fatalf("exit %s, want 137 and KILL", exitMsg)
	}
}

// shellExample builds examples/shell as its own module and attaches it to a
// pty here: the guest's shell sees the pty's size, then its new size after
// a resize (SIGWINCH), and the example exits with the shell's code.
func shellExample(t *testing.T, addr, id string) {
	bin := filepath.Join(t.TempDir(), "shell-example")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Dir = "../examples/shell"
	build.Env = append(os.Environ(), "GOWORK=off", "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the example: %v\n%s", err, out)
	}
	cmd := exec.Command(bin, "-addr", addr, id)
	cmd.Env = append(os.Environ(), "TERM=vt100")
	tty, err := pty.StartWithSize(cmd, &pty.Winsize{Rows: 30, Cols: 90})
	if err != nil {
		t.Fatal(err)
	}
	defer tty.Close()
	var mu sync.Mutex
	var out bytes.Buffer
	go func() {
		buf := make([]byte, 4096)
		for {
			n, err := tty.Read(buf)
			mu.Lock()
			out.Write(buf[:n])
			mu.Unlock()
			if err != nil {
				return
			}
		}
	}()
	expect := func(input, want string) {
		t.Helper()
		if _, err := io.WriteString(tty, input); err != nil {
			t.Fatal(err)
		}
		cluster.Eventually(t, time.Minute, "example output "+strconv.Quote(want), func() error {
			mu.Lock()
			defer mu.Unlock()
			if !strings.Contains(out.String(), want) {
				return errors.New("so far: " + strconv.Quote(out.String()))
			}
			return nil
		})
	}
	expect("stty size; echo T=$TERM\r", "30 90\r\nT=vt100")
	if err := pty.Setsize(tty, &pty.Winsize{Rows: 50, Cols: 120}); err != nil {
		t.Fatal(err)
	}
	expect("stty size\r", "50 120")
	if _, err := io.WriteString(tty, "exit 5\r"); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ExitCode() != 5 {
			mu.Lock()
			t.Fatalf("example: %v, want exit code 5; output %q", err, out.String())
		}
	case <-time.After(time.Minute):
		_ = cmd.Process.Kill()
		t.Fatal("the example did not exit")
	}
}

// TestExecWebSocketIdentity: with OIDC a WebSocket needs a token, in the
// Authorization header or, for browsers, as the subprotocol bearer.<token>;
// the hypervisor sees the caller (it verifies the token again). No VM boots:
// an unknown VM's not_found comes from the hypervisor, past both checks.
func TestExecWebSocketIdentity(t *testing.T) {
	op := oidctest.Start(t)
	images := t.TempDir()
	writeCatalog(t, images)
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{
		ImageDir: images, OIDCIssuer: op.Issuer(), OIDCAudiences: []string{op.Audience},
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	url := "ws://" + c.Addr + "/api/v1/vms/ffffffff/exec/ws"
	token := op.Token(oidctest.Claims{})

	if _, resp, err := websocket.Dial(ctx, url, &websocket.DialOptions{Subprotocols: []string{"vmm.exec.v1"}}); err == nil || resp == nil || resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("no token: %v %v, want 401", resp, err)
	}
	if _, resp, err := websocket.Dial(ctx, url, &websocket.DialOptions{Subprotocols: []string{"vmm.exec.v1", "bearer.not-a-token"}}); err == nil || resp == nil || resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("bad token: %v %v, want 401", resp, err)
	}
	for name, opts := range map[string]*websocket.DialOptions{
		"header":      {Subprotocols: []string{"vmm.exec.v1"}, HTTPHeader: http.Header{"Authorization": {"Bearer " + token}}},
		"subprotocol": {Subprotocols: []string{"vmm.exec.v1", "bearer." + token}},
	} {
		ws, _, err := websocket.Dial(ctx, url, opts)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if ws.Subprotocol() != "vmm.exec.v1" {
			t.Errorf("%s: subprotocol %q echoed", name, ws.Subprotocol())
		}
		_ = ws.Write(ctx, websocket.MessageText, []byte(`{"start":{"command":["true"]}}`))
		if _, data, err := ws.Read(ctx); err != nil || !strings.Contains(string(data), `"code": "not_found"`) {
			t.Errorf("%s: %s %v, want the hypervisor's not_found", name, data, err)
		}
		ws.CloseNow()
	}
}
