package agent

import (
	"context"
	"net"
	"os"
	"os/exec"
	"time"

	"github.com/giantswarm/vm-manager/guest/internal/initsys"
	"github.com/giantswarm/vm-manager/guest/internal/netcfg"
	"github.com/giantswarm/vm-manager/guest/internal/ocirun"
	"github.com/giantswarm/vm-manager/guest/internal/pcrextend"
)

// Bounds of the OCI boot's waits.
const (
	entrypointStartWait = 10 * time.Second
	entrypointStopGrace = 10 * time.Second
)

// ociBoot is the part of PID 1's boot that an OCI root on the command line
// adds (internal/ocirun); nil when there is none.
type ociBoot struct {
	root *ocirun.Root       // nil: the root was refused or failed
	sup  *ocirun.Supervisor // nil: no entrypoint running
}

// mountOCI checks, measures and mounts the root the command line names.
// It runs before the initrd-stage quote, which must cover PCR 15.
func mountOCI(con *Console) *ociBoot {
	cmdline, _ := os.ReadFile("/proc/cmdline")
	named, root := ocirun.Boot(ocirun.Options{
		Cmdline: string(cmdline),
		Logf:    con.Printf,
		Measure: func(pcr uint32, word, eventType string) error {
			_, err := pcrextend.New().Extend(pcr, word, eventType)
			return err
		},
		StartCmd: initsys.StartCmd,
	})
	if !named {
		return nil
	}
	return &ociBoot{root: root}
}

// start gives the root the network's files and starts the entrypoint,
// supervised; its output goes to the console.
func (b *ociBoot) start(con *Console, lease *netcfg.Lease) {
	if b == nil || b.root == nil {
		return
	}
	var dns []net.IP
	if lease != nil {
		dns = lease.DNS
	}
	host, _ := os.Hostname()
	b.root.SetNetwork(dns, host)
	if b.sup = b.root.Entrypoint(con.Line); b.sup != nil {
		go b.sup.Run()
	}
}

// command is sshd's command builder: inside the root when one is mounted.
func (b *ociBoot) command() func(context.Context, []string, []string) (*exec.Cmd, error) {
	if b == nil || b.root == nil {
		return nil
	}
	return b.root.Command
}

// waitStarted holds readiness until the entrypoint's first start was
// tried: an OCI VM is ready once its workload runs.
func (b *ociBoot) waitStarted(con *Console) {
	if b == nil || b.sup == nil {
		return
	}
	select {
	case <-b.sup.Started():
		if err := b.sup.FirstError(); err != nil {
			con.Printf("warning: the entrypoint did not start: %v", err)
		}
	case <-time.After(entrypointStartWait):
		con.Printf("warning: the entrypoint has not started within %s", entrypointStartWait)
	}
}

// stop ends the entrypoint before the power-off: SIGTERM, then SIGKILL.
func (b *ociBoot) stop(con *Console) {
	if b == nil || b.sup == nil {
		return
	}
	select {
	case <-b.sup.Done():
		return // it exited cleanly before
	default:
	}
	con.Printf("stopping the entrypoint")
	b.sup.Stop(entrypointStopGrace)
}
