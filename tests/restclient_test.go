package tests

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/gen/openapi"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/tests/cluster"
)

// The REST client generator, pinned: oapi-codegen reads the OpenAPI 3.1
// document as served (kin-openapi underneath) and writes types and a client.
const (
	oapiCodegen    = "github.com/oapi-codegen/oapi-codegen/v2/cmd/oapi-codegen@v2.8.2"
	oapiRuntime    = "github.com/oapi-codegen/runtime v1.9.0"
	restClientTool = "testdata/restclient/main.go.txt"
)

// TestGeneratedRESTClient is the "client generated from the document"
// acceptance: it fetches the document from a running gateway (the three
// binaries, the real test guest), generates a Go client from it with
// oapi-codegen in a throwaway module, builds testdata/restclient/main.go.txt
// against that client and runs it against the gateway. The program is
// written with the names a client generated from the original's document has
// (CreateVMRequest, CreateVM, GetVM, ExecVM, DeleteVM, …): host, images, a
// network created, read and deleted, the 404 envelope, and a VM created (its
// disk_gib 0 the default), read, exec'd in, its console and metrics read,
// and deleted. The generator and the module's dependencies come from the Go
// module proxy (GOPROXY as in the environment); only a missing go skips.
func TestGeneratedRESTClient(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("go is not installed: %v", err)
	}
	images := cluster.GuestImages(t, "..")
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images})
	base := "http://" + c.Addr

	// The document exactly as served, which is the one gen/ embeds.
	code, hdr, doc := cluster.Do(t, "GET", base+"/api/v1/openapi.json", "")
	if code != 200 || hdr.Get("Content-Type") != "application/json" {
		t.Fatalf("GET /api/v1/openapi.json: %d %q: %.200s", code, hdr.Get("Content-Type"), doc)
	}
	if !bytes.Equal(doc, openapi.JSON) {
		t.Errorf("the served document differs from gen/openapi/vmmanager.openapi.json")
	}
	var head struct {
		OpenAPI string
		Servers []struct{ URL string }
	}
	if err := json.Unmarshal(doc, &head); err != nil || head.OpenAPI != "3.1.0" || len(head.Servers) != 1 {
		t.Fatalf("served document: openapi %q, servers %v: %v", head.OpenAPI, head.Servers, err)
	}

	mod := t.TempDir()
	write := func(name string, b []byte) {
		t.Helper()
		p := filepath.Join(mod, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("openapi.json", doc)
	write("go.mod", []byte("module restclienttest\n\ngo 1.26\n\nrequire "+oapiRuntime+"\n"))
	prog, err := os.ReadFile(restClientTool)
	if err != nil {
		t.Fatal(err)
	}
	write("main.go", prog)

	// A module of its own: no go.work, and go.sum filled in from the proxy.
	env := append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod")
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Minute)
	defer cancel()
	run := func(what string, args ...string) {
		t.Helper()
		start := time.Now()
		cmd := exec.CommandContext(ctx, goBin, args...)
		cmd.Dir, cmd.Env = mod, env
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s: go %s: %v\n%s", what, strings.Join(args, " "), err, out)
		}
		t.Logf("%s took %v", what, time.Since(start).Round(time.Millisecond))
	}
	run("generate", "run", oapiCodegen, "-generate", "types,client", "-package", "client",
		"-o", filepath.Join(mod, "client", "client.gen.go"), filepath.Join(mod, "openapi.json"))
	exe := filepath.Join(mod, "restclient")
	run("build", "build", "-o", exe, ".")

	// The client's server is the document's, below the gateway's address,
	// as a client of the original is configured.
	cmd := exec.CommandContext(ctx, exe)
	cmd.Env = append(os.Environ(), "VMM_GATEWAY_URL="+base+head.Servers[0].URL)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("generated client: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	}
	t.Logf("generated client:\n%s", stdout.String())

	var host struct{ Ready bool }
	getJSON(t, base+"/api/v1/host", &host)
	var imgs []struct{ ID string }
	getJSON(t, base+"/api/v1/images", &imgs)
	var ids []string
	for _, i := range imgs {
		ids = append(ids, i.ID)
	}
	sort.Strings(ids)
	want := []string{
		fmt.Sprintf("host ready=%t", host.Ready),
		"images " + strings.Join(ids, " "),
		"network name=gen-client cidr=10.77.0.0/24 gateway=10.77.0.1",
		"vm error status=404 code=not_found",
		"vm created state=ready diskGiB=20",
		"vm read state=ready",
		`exec stdout="gen-client-vm\n" stderr="" exitCode=0`,
		"console lines=20",
		"metrics state=ready attestation=disabled",
		"vm deleted status=204",
		"network deleted status=204",
		"ok",
	}
	got := strings.Split(strings.TrimSuffix(stdout.String(), "\n"), "\n")
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("generated client printed\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	// Gone for the gateway too, not just for the client.
	expectError(t, "GET", base+"/api/v1/networks/gen-client", "", 404, apierr.NotFound)
	var vms []struct{ Name string }
	getJSON(t, base+"/api/v1/vms", &vms)
	if len(vms) != 0 {
		t.Errorf("VMs left after the client's delete: %+v", vms)
	}
}
