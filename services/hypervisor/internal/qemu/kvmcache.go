package qemu

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// bootIDPath changes with every boot of the host kernel.
var bootIDPath = "/proc/sys/kernel/random/boot_id"

// kvmProbeRecord is ProbeKVM's answer as kept between hypervisor starts.
type kvmProbeRecord struct {
	Key   string `json:"key"`
	CPU   string `json:"cpu,omitempty"`
	Error string `json:"error,omitempty"`
}

// ProbeKVMCached is ProbeKVM remembered in cacheFile for as long as nothing
// it depends on changes: the host's boot, the QEMU binary and the firmware
// (paths, sizes and modification times). It saves the up to 4 s per CPU
// model the probe costs on every restart of the hypervisor.
func ProbeKVMCached(ctx context.Context, cacheFile, binary, ovmfCode, ovmfVars string) (cpu string, cached bool, err error) {
	key, kerr := kvmProbeKey(binary, ovmfCode, ovmfVars)
	if kerr == nil {
		if b, rerr := os.ReadFile(cacheFile); rerr == nil {
			var rec kvmProbeRecord
			if json.Unmarshal(b, &rec) == nil && rec.Key == key {
				if rec.Error != "" {
					return "", true, errors.New(rec.Error)
				}
				return rec.CPU, true, nil
			}
		}
	}
	cpu, err = ProbeKVM(ctx, binary, ovmfCode, ovmfVars)
	if kerr != nil || ctx.Err() != nil {
		return cpu, false, err // an interrupted probe proves nothing
	}
	rec := kvmProbeRecord{Key: key, CPU: cpu}
	if err != nil {
		rec.Error = err.Error()
	}
	b, _ := json.Marshal(rec)
	tmp := cacheFile + ".tmp"
	if werr := os.WriteFile(tmp, b, 0o600); werr == nil {
		_ = os.Rename(tmp, cacheFile)
	}
	return cpu, false, err
}

func kvmProbeKey(binary, ovmfCode, ovmfVars string) (string, error) {
	boot, err := os.ReadFile(bootIDPath)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	fmt.Fprintf(h, "boot %s\n", strings.TrimSpace(string(boot)))
	if !strings.ContainsRune(binary, '/') {
		// A bare name is looked up in PATH, as exec does.
		if p, err := exec.LookPath(binary); err == nil {
			binary = p
		}
	}
	for _, f := range []string{binary, ovmfCode, ovmfVars} {
		abs, _ := filepath.Abs(f)
		fi, err := os.Stat(abs)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "%s %d %d\n", abs, fi.Size(), fi.ModTime().UnixNano())
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
