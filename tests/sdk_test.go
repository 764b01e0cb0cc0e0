package tests

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/tests/cluster"
)

// TestSDKExample builds examples/sdk as its own module (outside the
// workspace, importing the SDK by its module path) and runs it against the
// gateway and against the hypervisor's socket.
func TestSDKExample(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "sdk-example")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Dir = "../examples/sdk"
	build.Env = append(os.Environ(), "GOWORK=off", "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the example: %v\n%s", err, out)
	}
	images := t.TempDir()
	writeCatalog(t, images)
	c := cluster.Start(t, cluster.InProcess, binDir, cluster.Options{ImageDir: images})
	for _, addr := range []string{c.Addr, "unix://" + c.Socket("hypervisor")} {
		out, err := exec.Command(bin, "-addr", addr).CombinedOutput()
		if err != nil {
			t.Fatalf("example against %s: %v\n%s", addr, err, out)
		}
		for _, want := range []string{"host ", "network default 192.168.127.0/24", "vm ffffffff: not_found, as expected"} {
			if !strings.Contains(string(out), want) {
				t.Errorf("example against %s printed no %q:\n%s", addr, want, out)
			}
		}
	}
}
