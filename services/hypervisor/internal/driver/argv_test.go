package driver

import "testing"

func TestVMOfArgv(t *testing.T) {
	prefixes := []string{"/s/vms/"}
	for arg, want := range map[string]string{
		"dir=/s/vms/0a0b0c0d/tpm":             "0a0b0c0d",
		"file:/s/vms/0a0b0c0d/console.log":    "0a0b0c0d",
		"/s/vms/0a0b0c0d/ovmf_vars.fd":        "0a0b0c0d",
		"if=pflash,file=/s/vms/0a0b0c0d/x.fd": "0a0b0c0d",
		"path=/t/s/vms/0a0b0c0d/qmp.sock":     "", // another state directory
		"dir=/s/vms/../etc":                   "",
		"dir=/s/vms/0a0b0c0dd/tpm":            "",
	} {
		if got := vmOfArgv([]string{"qemu", arg}, prefixes); got != want {
			t.Errorf("vmOfArgv(%q) = %q, want %q", arg, got, want)
		}
	}
}
