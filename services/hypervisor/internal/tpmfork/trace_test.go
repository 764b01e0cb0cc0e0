package tpmfork

import (
	"bufio"
	"context"
	"encoding/hex"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/proc"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/swtpm"
)

// startTracedSwtpm is swtpm.Start with swtpm logging every TPM command and
// response (level 20), so the test sees what the guest sends the fork's TPM.
func startTracedSwtpm(t *testing.T, cfg swtpm.Config) {
	t.Helper()
	args := swtpm.Args(cfg)
	for i, a := range args {
		args[i] = strings.Replace(a, ",level=1", ",level=20", 1)
	}
	must(t, os.MkdirAll(cfg.StateDir, 0o700))
	pr, err := proc.Start(exec.Command(cfg.Binary, args...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pr.Terminate(swtpm.StopGrace) })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	must(t, swtpm.Probe(ctx, cfg.CtrlSocket))
	must(t, os.Truncate(cfg.LogFile, 0)) // from here on: the fork's traffic
}

// guestCommands pairs each TPM command in an swtpm level-20 log with its
// response code: [command code, response code].
func guestCommands(t *testing.T, logFile string, from int64) [][2]uint32 {
	t.Helper()
	f, err := os.Open(logFile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Seek(from, io.SeekStart); err != nil {
		t.Fatal(err)
	}
	var out [][2]uint32
	var next string // which header the following hex line belongs to
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := strings.TrimSpace(sc.Text())
		switch {
		case strings.HasPrefix(l, "SWTPM_IO_Read:"):
			next = "cmd"
		case strings.HasPrefix(l, "SWTPM_IO_Write:"):
			next = "rsp"
		case next != "":
			b, err := hex.DecodeString(strings.ReplaceAll(l, " ", ""))
			if err != nil || len(b) < 10 {
				next = ""
				continue
			}
			v := uint32(b[6])<<24 | uint32(b[7])<<16 | uint32(b[8])<<8 | uint32(b[9])
			if next == "cmd" {
				out = append(out, [2]uint32{v, 0xffffffff})
			} else if len(out) > 0 {
				out[len(out)-1][1] = v
			}
			next = ""
		}
	}
	return out
}

func fileSize(p string) int64 {
	fi, err := os.Stat(p)
	if err != nil {
		return 0
	}
	return fi.Size()
}
