package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/tests/cluster"
)

// A backend that hangs (here SIGSTOP) rather than exits still holds its
// socket, so a call to it used to wait as long as its caller did. The mesh's
// keepalive gives such a connection up: the call ends with 503 unavailable,
// the other backend keeps answering, and once the hung one runs again its
// calls succeed without a restart of anything.
func TestHungBackend(t *testing.T) {
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{Quiet: true})
	base := "http://" + c.Addr + "/api/v1"
	// get answers the status and error code of one call; the client's own
	// limit is far beyond the keepalive's, so hitting it means a hang.
	get := func(path string) (int, string, time.Duration) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "GET", base+path, nil)
		began := time.Now()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("GET %s: %v after %s: the call hung", path, err, time.Since(began).Round(time.Second))
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		var e struct {
			Error struct{ Code string } `json:"error"`
		}
		_ = json.Unmarshal(b, &e)
		return resp.StatusCode, e.Error.Code, time.Since(began)
	}
	// A policy is attestation's to answer (404: none imported), the VM list
	// the hypervisor's.
	const policy, vms = "/images/test-guest_0.1.0/policy", "/vms"
	want := map[string]int{policy: http.StatusNotFound, vms: http.StatusOK}
	for _, tc := range []struct{ victim, path, other string }{
		{"attestation", policy, vms},
		{"hypervisor", vms, policy},
	} {
		t.Run(tc.victim, func(t *testing.T) {
			if code, _, _ := get(tc.path); code != want[tc.path] { // the gateway's connection is up
				t.Fatalf("GET %s before: %d", tc.path, code)
			}
			pid := c.Pid(tc.victim)
			if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			// kill returns once the signal is queued; the process stops
			// when its threads next run. Until then it may answer.
			cluster.Eventually(t, 5*time.Second, tc.victim+" stopped", func() error {
				b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
				if err != nil {
					return err
				}
				if f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:])); len(f) == 0 || f[0] != "T" {
					return fmt.Errorf("state %v", f)
				}
				return nil
			})
			resumed := false
			resume := func() {
				if !resumed {
					resumed = true
					_ = syscall.Kill(pid, syscall.SIGCONT)
				}
			}
			t.Cleanup(resume)
			for i := range 2 { // on the open connection, then on a new one
				code, ecode, took := get(tc.path)
				t.Logf("GET %s with %s stopped (call %d): %d %s after %s", tc.path, tc.victim, i+1, code, ecode, took.Round(100*time.Millisecond))
				if code != http.StatusServiceUnavailable || ecode != "unavailable" {
					t.Errorf("GET %s with %s stopped: %d %q, want 503 unavailable", tc.path, tc.victim, code, ecode)
				}
			}
			if code, _, _ := get(tc.other); code != want[tc.other] {
				t.Errorf("GET %s while %s is stopped: %d", tc.other, tc.victim, code)
			}
			resume()
			cluster.Eventually(t, 20*time.Second, tc.victim+" answering again", func() error {
				if code, _, _ := get(tc.path); code != want[tc.path] {
					return fmt.Errorf("GET %s: %d", tc.path, code)
				}
				return nil
			})
		})
	}
}
