package tpmfork

import (
	"os"
	"testing"
)

// need skips when a host tool is missing, but fails in CI, where a skip
// would hide that the integration tests never ran.
func need(t *testing.T, what string, ok bool) {
	t.Helper()
	if ok {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s is missing (CI=true: integration tests must run)", what)
	}
	t.Skipf("%s is missing: install qemu-system-x86, ovmf and swtpm and build the test guest (make guest-image) to run this test", what)
}
