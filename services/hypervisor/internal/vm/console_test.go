package vm

import (
	"fmt"
	"github.com/giantswarm/vm-manager/pkg/poll"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/consolelog"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/logtail"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
)

// The console loop keeps console.log and console.log.1 under the cap from
// the hypervisor's start (a file that grew while it was down is rotated at
// once), serves the tail across both, counts rotations; a console whose
// QEMU writes without O_APPEND is left alone (cutting it would leave a hole).
func TestConsoleRotation(t *testing.T) {
	h := newHarness(t)
	h.m.Close()
	const limit = 64 << 10
	h.tweak = func(c *Config) { c.ConsoleLogMaxBytes, c.ConsoleCheckInterval = limit, 10*time.Millisecond }
	dir := t.TempDir()
	grown, unsafe := dir+"/grown.log", dir+"/unsafe.log"
	var big strings.Builder
	for i := range 20000 {
		fmt.Fprintf(&big, "line %06d\r\n", i)
	}
	for _, p := range []string{grown, unsafe} {
		if err := os.WriteFile(p, []byte(big.String()), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// A writer without O_APPEND, as QEMU's -serial file: before append=on.
	holder := exec.Command("/bin/sh", "-c", "exec sleep 60 1<>'"+unsafe+"'")
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { holder.Process.Kill(); holder.Wait() })
	// Until the shell has opened it, nothing writes the file and rotating it is right.
	poll.Until(t, "the holder to open "+unsafe, func() bool {
		ok, err := consolelog.AppendOnly(holder.Process.Pid, unsafe)
		return err == nil && !ok
	})
	for i, c := range []struct {
		id, path string
		pid      int
	}{{"0c000001", grown, 0}, {"0c000002", unsafe, holder.Process.Pid}} {
		rec := &storepb.VirtualMachine{Id: c.id, Name: fmt.Sprintf("c%d", i), State: hypervisorv1.State_STATE_STOPPED,
			Paths: &hypervisorv1.Paths{Dir: dir, Console: c.path}}
		if c.pid != 0 {
			rec.State = hypervisorv1.State_STATE_READY
			rec.Processes = &storepb.Processes{Qemu: &storepb.Process{Pid: int32(c.pid)}}
		}
		if err := h.st.PutVM(rec); err != nil {
			t.Fatal(err)
		}
	}
	h.start()

	deadline := time.Now().Add(5 * time.Second)
	for h.m.ConsoleCounters()["0c000001"].Rotations == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	c := h.m.ConsoleCounters()["0c000001"]
	if c.Rotations != 1 || c.RotatedBytes != uint64(big.Len()) || c.DroppedBytes == 0 {
		t.Fatalf("counters after the first pass: %+v", c)
	}
	if total := fileSize(grown) + fileSize(logtail.Predecessor(grown)); total > limit {
		t.Errorf("console files hold %d bytes, the cap is %d", total, limit)
	}
	if got := logtail.Lines(grown, 2); got != "line 019998\nline 019999" {
		t.Errorf("tail after the rotation: %q", got)
	}
	con, err := h.m.Console("0c000001", 1)
	if err != nil || con.GetConsole() != "line 019999" {
		t.Errorf("console API: %v %v", con, err)
	}
	bc := h.m.BoundCounters()
	if len(bc.GetVms()) != 2 || bc.GetVms()[0].GetConsoleRotationsTotal() != 1 || bc.GetVms()[0].GetConsoleDroppedBytesTotal() != c.DroppedBytes ||
		bc.GetVms()[0].GetImdsBodyTooLargeTotal()["quote"] != 0 || bc.GetRefusedTotal()["vms"] != 0 {
		t.Errorf("bound counters %v", bc)
	}
	// The pass that left the unsafe console alone says so (once); only then is
	// "not rotated" a result rather than "not yet looked at".
	mc, err := h.m.get("0c000002")
	if err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the console loop to pass the unsafe console", mc.console.unsafe.Load)
	if fileSize(unsafe) != int64(big.Len()) || h.m.ConsoleCounters()["0c000002"].Rotations != 0 {
		t.Errorf("a console written without O_APPEND was rotated")
	}
}

func fileSize(p string) int64 {
	fi, err := os.Stat(p)
	if err != nil {
		return 0
	}
	return fi.Size()
}
