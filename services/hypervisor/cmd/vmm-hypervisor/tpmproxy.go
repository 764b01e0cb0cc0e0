package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/tpmfork"
)

// tpmProxyCommand is a fork's vTPM control-channel proxy as a process of
// its own (the driver starts it; tpmfork/process.go says why).
func tpmProxyCommand() cli.Command {
	return cli.Command{
		Name:  "tpm-proxy",
		Usage: "relay a fork's QEMU to its swtpm's control socket, giving its incoming migration the fork's vTPM state (started by the hypervisor)",
		Setup: func(fs *cli.FlagSet) func(context.Context) error {
			listen := fs.String("listen", "", "", "the socket QEMU's tpm-emulator connects to")
			ctrl := fs.String("swtpm-ctrl", "", "", "swtpm's control socket")
			permanent := fs.String("permanent", "", "", "the fork's permanent state blob")
			volatile := fs.String("volatile", "", "", "the fork's volatile state blob")
			report := fs.String("report", "", "", "where to write whether the fork's state was taken")
			idle := fs.Duration("idle", "", time.Minute, "how long to wait for QEMU")
			return func(ctx context.Context) error {
				if *listen == "" || *ctrl == "" || *permanent == "" || *volatile == "" || *report == "" {
					return fmt.Errorf("--listen, --swtpm-ctrl, --permanent, --volatile and --report are required")
				}
				logf := func(format string, args ...any) { fmt.Fprintf(os.Stderr, format+"\n", args...) }
				return tpmfork.Serve(ctx, *listen, *ctrl, *permanent, *volatile, *report, *idle, logf)
			}
		},
	}
}
