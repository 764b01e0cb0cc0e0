package server

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// importer is a hypervisor whose ImportImage streams RESOLVING, LAYERS and
// DONE; for the source "block" it sends RESOLVING and waits for its call
// to end (closing ended), for "hostile" it fails with invalid_request.
type importer struct {
	hypervisorv1.UnimplementedHypervisorServiceServer
	ended chan struct{}
}

func (f importer) ImportImage(req *hypervisorv1.ImportImageRequest, ss grpc.ServerStreamingServer[hypervisorv1.ImportImageResponse]) error {
	switch req.GetSource() {
	case "hostile":
		return apierr.ToStatus(apierr.Errorf(apierr.InvalidRequest, "layer sha256:ab12: entry ../etc/passwd: a path out of the root")).Err()
	case "block":
		if err := ss.Send(&hypervisorv1.ImportImageResponse{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_RESOLVING}); err != nil {
			return err
		}
		<-ss.Context().Done()
		close(f.ended)
		return ss.Context().Err()
	}
	for _, m := range []*hypervisorv1.ImportImageResponse{
		{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_RESOLVING},
		{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS, BytesDone: 10, BytesTotal: 20, Layer: "sha256:ab12"},
		{Phase: hypervisorv1.ImportPhase_IMPORT_PHASE_DONE, Image: &hypervisorv1.Image{Id: req.GetId(), Version: "3.12", Ref: req.GetId() + "_3.12"}},
	} {
		if err := ss.Send(m); err != nil {
			return err
		}
	}
	return nil
}

// ImportImage through the gateway: REST streams NDJSON ending in DONE, a
// hypervisor's error keeps the envelope, a REST client that leaves cancels
// the import, and the gRPC forwarder relays the stream.
func TestImportImageThroughTheGateway(t *testing.T) {
	dir := t.TempDir()
	ln, err := net.Listen("unix", dir+"/hypervisor.sock")
	if err != nil {
		t.Fatal(err)
	}
	fake := importer{ended: make(chan struct{})}
	gs := grpc.NewServer()
	hypervisorv1.RegisterHypervisorServiceServer(gs, fake)
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)
	addr, cancel, done := startGateway(t, dir)
	t.Cleanup(func() { cancel(); <-done })
	ctx, cctx := context.WithTimeout(context.Background(), 20*time.Second)
	defer cctx()

	post := func(ctx context.Context, body string) *http.Response {
		t.Helper()
		req, _ := http.NewRequestWithContext(ctx, "POST", "http://"+addr+"/api/v1/images:import", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}

	resp := post(ctx, `{"source":"localhost:5000/python:3.12","id":"python"}`)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	lines := strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/x-ndjson" || len(lines) != 3 {
		t.Fatalf("%d %s:\n%s", resp.StatusCode, resp.Header.Get("Content-Type"), b)
	}
	var last struct {
		Result struct {
			Phase string
			Image struct{ Ref string }
		}
	}
	if err := json.Unmarshal([]byte(lines[2]), &last); err != nil || last.Result.Phase != "done" || last.Result.Image.Ref != "python_3.12" {
		t.Errorf("last line %s", lines[2])
	}
	if !strings.HasPrefix(lines[1], `{"result":{"phase":"layers","bytesDone":10,"bytesTotal":20,"layer":"sha256:ab12"`) {
		t.Errorf("line 1 %s", lines[1])
	}

	resp = post(ctx, `{"source":"hostile"}`)
	b, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if want := string(apierr.RESTBody(apierr.Errorf(apierr.InvalidRequest, "layer sha256:ab12: entry ../etc/passwd: a path out of the root"))); resp.StatusCode != 400 || string(b) != want {
		t.Errorf("hostile: %d %s, want 400 %s", resp.StatusCode, b, want)
	}

	// A REST client that goes away cancels the import.
	rctx, rcancel := context.WithCancel(ctx)
	resp = post(rctx, `{"source":"block"}`)
	if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.Contains(line, `"phase":"resolving"`) {
		t.Fatalf("first line %q: %v", line, err)
	}
	rcancel()
	resp.Body.Close()
	select {
	case <-fake.ended:
	case <-time.After(10 * time.Second):
		t.Fatal("the hypervisor's import was not cancelled when the REST client left")
	}

	// gRPC: the forwarder relays the stream as it is.
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	stream, err := hypervisorv1.NewHypervisorServiceClient(conn).ImportImage(ctx, &hypervisorv1.ImportImageRequest{Source: "x", Id: "x"})
	if err != nil {
		t.Fatal(err)
	}
	var phases []hypervisorv1.ImportPhase
	for {
		m, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		phases = append(phases, m.GetPhase())
	}
	if len(phases) != 3 || phases[2] != hypervisorv1.ImportPhase_IMPORT_PHASE_DONE {
		t.Errorf("gRPC phases %v", phases)
	}
}
