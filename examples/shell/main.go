// Command shell attaches the local terminal to a command in a VM over the
// SDK's ExecVirtualMachineStream: a shell by default. When stdin is a
// terminal it runs in raw mode on a pty in the guest, and window size
// changes (SIGWINCH) follow; otherwise stdin, stdout and stderr are piped
// and SIGINT/SIGTERM are passed on. It exits with the command's code.
//
//	go run . -addr 127.0.0.1:8080 [-token $ID_TOKEN] <vm-id> [-- command args…]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/term"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/client"
)

func main() {
	addr := flag.String("addr", envOr("VMM_ADDR", "127.0.0.1:8080"), "gateway host:port or unix:///path of the hypervisor's socket (env VMM_ADDR)")
	token := flag.String("token", os.Getenv("VMM_TOKEN"), "bearer token, an OIDC id_token (env VMM_TOKEN)")
	tty := flag.String("tty", "auto", "a pty in the guest: auto (when stdin is a terminal), always, never")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: %s [flags] <vm-id> [-- command args…]\n", os.Args[0])
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() < 1 {
		flag.Usage()
		os.Exit(2)
	}
	command := flag.Args()[1:]
	if len(command) > 0 && command[0] == "--" { // flag stops at the id, so "--" comes through
		command = command[1:]
	}
	code, err := run(*addr, *token, *tty, flag.Arg(0), command)
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
	os.Exit(code)
}

func run(addr, token, tty, id string, command []string) (int, error) {
	var opts []client.Option
	if token != "" {
		opts = append(opts, client.WithToken(token))
	}
	c, err := client.Dial(addr, opts...)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	stdin := int(os.Stdin.Fd())
	usePty := tty == "always" || (tty == "auto" && term.IsTerminal(stdin))
	start := &hypervisorv1.ExecStart{Id: id, Command: command}
	if usePty {
		cols, rows, err := term.GetSize(stdin)
		if err != nil {
			cols, rows = 80, 24
		}
		start.Pty = &hypervisorv1.ExecPty{Term: envOr("TERM", "xterm"), Rows: uint32(rows), Cols: uint32(cols)}
	}
	stream, err := c.Hypervisor.ExecVirtualMachineStream(ctx)
	if err != nil {
		return 0, err
	}
	if err := stream.Send(&hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_Start{Start: start}}); err != nil {
		return 0, recvErr(stream, err)
	}
	if usePty && term.IsTerminal(stdin) {
		old, err := term.MakeRaw(stdin)
		if err != nil {
			return 0, err
		}
		defer func() { _ = term.Restore(stdin, old) }()
	}

	// Sends come from several goroutines; a gRPC stream takes one at a time.
	sends := make(chan *hypervisorv1.ExecVirtualMachineStreamRequest, 16)
	go func() {
		for req := range sends {
			if stream.Send(req) != nil {
				return // Recv below says why
			}
		}
	}()
	go func() {
		buf := make([]byte, 32<<10)
		for {
			n, err := os.Stdin.Read(buf)
			if n > 0 {
				sends <- &hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_Stdin{Stdin: append([]byte(nil), buf[:n]...)}}
			}
			if err != nil {
				sends <- &hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_StdinClose{StdinClose: &hypervisorv1.ExecStdinClose{}}}
				return
			}
		}
	}()
	sigs := make(chan os.Signal, 4)
	if usePty {
		signal.Notify(sigs, syscall.SIGWINCH)
	} else {
		signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	}
	go func() {
		for s := range sigs {
			if s == syscall.SIGWINCH {
				if cols, rows, err := term.GetSize(stdin); err == nil {
					sends <- &hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_Resize{Resize: &hypervisorv1.ExecWindowSize{Rows: uint32(rows), Cols: uint32(cols)}}}
				}
				continue
			}
			name := map[os.Signal]string{syscall.SIGINT: "INT", syscall.SIGTERM: "TERM", syscall.SIGHUP: "HUP"}[s]
			sends <- &hypervisorv1.ExecVirtualMachineStreamRequest{Kind: &hypervisorv1.ExecVirtualMachineStreamRequest_Signal{Signal: name}}
		}
	}()

	for {
		resp, err := stream.Recv()
		if err != nil {
			return 0, err
		}
		switch k := resp.GetKind().(type) {
		case *hypervisorv1.ExecVirtualMachineStreamResponse_Stdout:
			_, _ = os.Stdout.Write(k.Stdout)
		case *hypervisorv1.ExecVirtualMachineStreamResponse_Stderr:
			_, _ = os.Stderr.Write(k.Stderr)
		case *hypervisorv1.ExecVirtualMachineStreamResponse_Exit:
			return int(k.Exit.GetExitCode()), nil
		}
	}
}

// recvErr is the call's status when a Send failed because the call ended.
func recvErr(stream hypervisorv1.HypervisorService_ExecVirtualMachineStreamClient, err error) error {
	if errors.Is(err, io.EOF) {
		if _, rerr := stream.Recv(); rerr != nil {
			return rerr
		}
	}
	return err
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
