// Command vm-agent is the guest agent. As PID 1 it is the init of the project's test
// guest initramfs; otherwise it is a CLI (notify, attest, pcrs, version) and,
// in a real OS under systemd (the vm-base image), the installer (install),
// provisioning from the IMDS (provision) and the end of the boot (up).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/giantswarm/vm-manager/guest/internal/agent"
	"github.com/giantswarm/vm-manager/guest/internal/attest"
	"github.com/giantswarm/vm-manager/guest/internal/imdsclient"
	"github.com/giantswarm/vm-manager/guest/internal/sdnotify"
	"github.com/giantswarm/vm-manager/guest/internal/smbios"
	"github.com/giantswarm/vm-manager/guest/internal/version"
)

func main() {
	if os.Getpid() == 1 {
		agent.RunInit(agent.NewConsole(os.Stdout))
		return
	}
	os.Exit(run(os.Args[1:]))
}

const usage = `usage:
  vm-agent notify [--socket vsock-stream:2:<port> | --port /dev/vportNpM] KEY=VALUE...
  vm-agent attest --stage=initrd|ready [--imds-url URL] [--tpm PATH] [--timeout 90s] [--print] [--nonce HEX] [--record FILE]
  vm-agent pcrs [--bank=sha256] [--tpm=PATH]
  vm-agent install      (systemd initrd: copy the image onto vm.install-target)
  vm-agent provision    (hostname and root's SSH keys from the IMDS)
  vm-agent up           (ready-stage quote, READY=1, then reports every 15 s)
  vm-agent version`

func run(args []string) int {
	if len(args) == 0 {
		fmt.Fprintln(os.Stderr, usage)
		return 2
	}
	switch args[0] {
	case "version":
		fmt.Println("vm-agent", version.Version)
		return 0
	case "notify":
		if err := notifyCmd(args[1:]); err != nil {
			fmt.Fprintln(os.Stderr, "vm-agent notify:", err)
			return 1
		}
		return 0
	case "attest":
		// Exit codes: 0 verified, 2 rejected, 1 anything else. --record
		// leaves the outcome where `vm-agent up` reports it.
		rest, record := cutRecord(args[1:])
		code := attest.Command(rest, os.Stdout, os.Stderr)
		if record != "" {
			agent.RecordAttestResult(record, code)
		}
		return code
	case "install":
		con := agent.NewConsole(os.Stdout)
		if err := agent.Install(con); err != nil {
			con.Printf("installer failed: %v", err)
			return 1
		}
		return 0
	case "provision":
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		agent.Provision(ctx, agent.NewConsole(os.Stdout), imdsclient.DefaultURL)
		return 0
	case "up":
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		con := agent.NewConsole(os.Stdout)
		if err := agent.Up(ctx, con, imdsclient.DefaultURL, attest.DefaultTPMPath); err != nil {
			con.Printf("%v", err)
			return 1
		}
		return 0
	case "pcrs":
		return attest.PCRsCommand(args[1:], os.Stdout, os.Stderr)
	case "-h", "--help", "help":
		fmt.Println(usage)
		return 0
	default:
		fmt.Fprintln(os.Stderr, usage)
		return 2
	}
}

// cutRecord takes --record FILE (or --record=FILE) out of attest's arguments.
func cutRecord(args []string) (rest []string, record string) {
	for i := 0; i < len(args); i++ {
		switch a := args[i]; {
		case strings.HasPrefix(a, "--record="):
			record = strings.TrimPrefix(a, "--record=")
		case a == "--record" && i+1 < len(args):
			record = args[i+1]
			i++
		default:
			rest = append(rest, a)
		}
	}
	return rest, record
}

func notifyCmd(args []string) error {
	fs := flag.NewFlagSet("notify", flag.ContinueOnError)
	socket := fs.String("socket", "", "vsock address vsock-stream:<cid>:<port> (default: the vmm.notify_socket credential)")
	port := fs.String("port", "", "virtio-serial port device, e.g. /dev/vport1p1 (default: the port named "+sdnotify.PortName+")")
	if err := fs.Parse(args); err != nil {
		return err
	}
	msg, err := sdnotify.Message(fs.Args()...)
	if err != nil {
		return err
	}
	var s sdnotify.Sender
	switch {
	case *port != "" && *socket != "":
		return fmt.Errorf("--port and --socket exclude each other")
	case *port != "":
		s, err = sdnotify.OpenSerial(*port)
	case *socket != "":
		var a sdnotify.Address
		if a, err = sdnotify.ParseAddress(*socket); err == nil {
			s = &sdnotify.Vsock{Addr: a}
		}
	default:
		// Same choice as PID 1: the named port, else the credential.
		creds, _ := smbios.ReadCredentials(smbios.DefaultEntriesDir)
		s, err = sdnotify.Select(context.Background(), sdnotify.DefaultPaths, 0, string(creds[agent.CredNotifySocket]))
	}
	if err != nil {
		return err
	}
	defer s.Close()
	// A virtio-serial write blocks while the host is not connected.
	done := make(chan error, 1)
	go func() { done <- s.Send(msg) }()
	select {
	case err := <-done:
		return err
	case <-time.After(30 * time.Second):
		return fmt.Errorf("%s: timed out", s)
	}
}
