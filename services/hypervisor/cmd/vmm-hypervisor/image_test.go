package main

import (
	"bytes"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/registry"

	"github.com/giantswarm/vm-manager/pkg/cli"
)

func TestImageArgsSplit(t *testing.T) {
	cases := []struct {
		in, out, pos []string
	}{
		{[]string{"serve", "--x"}, []string{"serve", "--x"}, nil},
		{[]string{"image"}, []string{"image"}, nil},
		{[]string{"image", "bogus", "a"}, []string{"image bogus", "a"}, nil},
		{
			[]string{"image", "pull", "reg/repo:1", "--image-dir=/var/lib/vm-manager/images", "--plain-http"},
			[]string{"image pull", "--image-dir=/var/lib/vm-manager/images", "--plain-http"},
			[]string{"reg/repo:1"},
		},
		{
			[]string{"image", "pull", "--image-dir", "/d", "--plain-http", "reg/repo@sha256:00"},
			[]string{"image pull", "--image-dir", "/d", "--plain-http"},
			[]string{"reg/repo@sha256:00"},
		},
		{
			[]string{"image", "push", "-plain-http", "dir", "--log-level", "debug", "reg/repo:1"},
			[]string{"image push", "-plain-http", "--log-level", "debug"},
			[]string{"dir", "reg/repo:1"},
		},
		{
			[]string{"image", "push", "--plain-http", "--", "--dir", "reg/repo:1"},
			[]string{"image push", "--plain-http"},
			[]string{"--dir", "reg/repo:1"},
		},
	}
	for _, c := range cases {
		ia := &imageArgs{}
		cmds := []cli.Command{serveCommand(), imagePushCommand(ia, io.Discard), imagePullCommand(ia, io.Discard)}
		out := ia.split(c.in, cmds)
		if !reflect.DeepEqual(out, c.out) || !reflect.DeepEqual(ia.args, c.pos) {
			t.Errorf("split(%q) = %q, %q; want %q, %q", c.in, out, ia.args, c.out, c.pos)
		}
	}
}

// The real binary: image push, then image pull twice (the second a no-op),
// against an in-memory registry over plain HTTP.
func TestImageCommands(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	bin := filepath.Join(t.TempDir(), "vmm-hypervisor")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")

	src := t.TempDir()
	files := map[string]string{
		"test-guest_0.1.0.vmlinuz":        "MZ kernel",
		"test-guest_0.1.0.initrd":         "initrd",
		"test-guest_0.1.0.cmdline":        "console=ttyS0 panic=-1\n",
		"sysupdate/kubernetes/SHA256SUMS": "00  kubernetes_1.33.1.raw\n",
	}
	for name, data := range files {
		p := filepath.Join(src, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	env := append(os.Environ(), "DOCKER_CONFIG="+t.TempDir())
	run := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(bin, args...)
		cmd.Env = env
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("vmm-hypervisor %q: %v\n%s%s", args, err, stdout.String(), stderr.String())
		}
		return stdout.String()
	}

	ref := host + "/vm-manager-guest-image:0.1.0"
	out := run("image", "push", src, ref, "--plain-http")
	m := regexp.MustCompile(`(?m)^digest: (sha256:[0-9a-f]{64})$`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("push printed no digest:\n%s", out)
	}
	digest := m[1]
	for name := range files {
		if !strings.Contains(out, "\n  "+name+"\n") {
			t.Errorf("push output lacks %s:\n%s", name, out)
		}
	}

	// As the Helm chart's init container runs it.
	dir := filepath.Join(t.TempDir(), "images")
	out = run("image", "pull", ref, "--image-dir="+dir, "--plain-http")
	if !strings.Contains(out, "digest: "+digest+"\n") || !strings.Contains(out, "status: pulled\n") {
		t.Errorf("pull output:\n%s", out)
	}
	for name, data := range files {
		b, err := os.ReadFile(filepath.Join(dir, filepath.FromSlash(name)))
		if err != nil || string(b) != data {
			t.Errorf("%s: %q, %v", name, b, err)
		}
	}
	out = run("image", "pull", host+"/vm-manager-guest-image@"+digest, "--image-dir", dir, "--plain-http")
	if !strings.Contains(out, "status: unchanged") {
		t.Errorf("second pull is not a no-op:\n%s", out)
	}

	// Errors exit non-zero with the reason.
	cmd := exec.Command(bin, "image", "push", src, host+"/vm-manager-guest-image", "--plain-http")
	cmd.Env = env
	if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "needs a tag") {
		t.Errorf("push without a tag: %v\n%s", err, out)
	}
}
