package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/giantswarm/vm-manager/pkg/buildinfo"
)

// Command is a subcommand: its flags are defined on fs, run is called after parsing.
type Command struct {
	Name  string
	Usage string
	Setup func(fs *FlagSet) func(ctx context.Context) error
}

// Main dispatches "<prog> <command> [flags]" and "<prog> version", runs the
// command until SIGINT or SIGTERM, and returns the exit code.
func Main(prog, about string, args []string, stderr io.Writer, cmds ...Command) int {
	usage := func() {
		fmt.Fprintf(stderr, "%s: %s\n\nUsage:\n", prog, about)
		for _, c := range cmds {
			fmt.Fprintf(stderr, "  %s %s [flags]\t%s\n", prog, c.Name, c.Usage)
		}
		fmt.Fprintf(stderr, "  %s version\n\nRun '%s <command> --help' for the flags and their environment variables.\n", prog, prog)
	}
	if len(args) == 0 {
		usage()
		return 2
	}
	switch args[0] {
	case "version", "--version":
		fmt.Fprintf(os.Stdout, "%s %s (commit %s)\n", prog, buildinfo.Version, buildinfo.CommitOrVCS())
		return 0
	case "help", "-h", "--help":
		usage()
		return 0
	}
	for _, c := range cmds {
		if c.Name != args[0] {
			continue
		}
		fs := New(prog+" "+c.Name, c.Usage)
		fs.SetOutput(stderr)
		run := c.Setup(fs)
		if err := fs.Parse(args[1:], nil); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				return 0
			}
			fmt.Fprintf(stderr, "%s %s: %v\n", prog, c.Name, err)
			return 2
		}
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		if err := run(ctx); err != nil {
			fmt.Fprintf(stderr, "%s %s: %v\n", prog, c.Name, err)
			return 1
		}
		return 0
	}
	fmt.Fprintf(stderr, "%s: unknown command %q\n", prog, args[0])
	usage()
	return 2
}
