package cluster

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// GuestImages returns the directory holding the test guest built by `make
// guest-image`: $VMM_TEST_IMAGE_DIR, else <repoRoot>/.run/state/images, where
// repoRoot is the repository's root relative to the test's directory. It
// also requires QEMU and swtpm. Anything missing fails the test on CI
// (CI=true) and skips it elsewhere.
func GuestImages(t testing.TB, repoRoot string) string {
	t.Helper()
	dir := os.Getenv("VMM_TEST_IMAGE_DIR")
	if dir == "" {
		dir, _ = filepath.Abs(filepath.Join(repoRoot, ".run/state/images"))
	}
	matches, _ := filepath.Glob(filepath.Join(dir, "test-guest_*.vmlinuz"))
	if len(matches) == 0 {
		if os.Getenv("CI") == "true" {
			t.Fatalf("no test guest in %s: make test builds it with make guest-image", dir)
		}
		t.Skipf("no test guest in %s (VMM_TEST_IMAGE_DIR, or run make guest-image)", dir)
	}
	RequireTool(t, "qemu-system-x86_64")
	RequireTool(t, "swtpm")
	return dir
}

// RequireTool returns the path of an executable on PATH; without it the test
// fails on CI (CI=true) and is skipped elsewhere.
func RequireTool(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err == nil {
		return p
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s is required on CI (make test installs it): %v", name, err)
	}
	t.Skipf("%s not installed (run make deps): %v", name, err)
	return ""
}

// TempDir is a new directory removed at the end of the test. Not t.TempDir:
// unix socket paths must stay under 108 bytes, and t.TempDir's can be long.
func TempDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "vmm-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// FreeAddr picks a free loopback host:port.
func FreeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// Do sends an HTTP request, with body as JSON when there is one, and returns
// the status, the headers and the body. Only a request that gets no response
// fails the test.
func Do(t testing.TB, method, url, body string) (int, http.Header, []byte) {
	t.Helper()
	return DoContext(context.Background(), t, method, url, body, nil)
}

// DoContext is Do bounded by ctx, with header's fields (if any) added to the
// request.
func DoContext(ctx context.Context, t testing.TB, method, url, body string, header http.Header) (int, http.Header, []byte) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	for k, vs := range header {
		for _, v := range vs {
			req.Header.Add(k, v)
		}
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, b
}

// Readyz is nil when the gateway at addr (host:port) answers /readyz with 200.
func Readyz(addr string) error { return readyzWith(http.DefaultClient, "http://"+addr) }

func readyzWith(client *http.Client, base string) error {
	resp, err := client.Get(base + "/readyz")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%d %s", resp.StatusCode, b)
	}
	return nil
}

// Running reports whether pid is a live process, not a zombie: QEMU and
// swtpm outlive the hypervisor that started them, and whoever inherits them
// may not reap them at once.
func Running(pid int) bool {
	if pid <= 0 {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	return err == nil && !strings.Contains(string(b), ") Z ")
}

// KillLeftovers SIGKILLs those of pids (a VM's QEMU and swtpm) still
// running, so none outlives a failed test.
func KillLeftovers(t testing.TB, pids ...int) {
	t.Helper()
	for _, pid := range pids {
		if Running(pid) {
			t.Logf("killing leftover pid %d", pid)
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}
