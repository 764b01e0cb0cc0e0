// Package observe starts what every serving process is observed by, the same
// way in each: its logger (pkg/logging) and its tracing (pkg/tracing).
package observe

import (
	"context"
	"log/slog"

	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/pkg/logging"
	"github.com/giantswarm/vm-manager/pkg/tracing"
)

// Run is a serve command's work, given the logger it logs with.
type Run func(ctx context.Context, log *slog.Logger) error

// Flags defines the logging flags (logging.Flags: --log-format, and
// --log-level defaulting to level) and the tracing flags (tracing.Flags) on
// fs. The function it returns wraps run for cli.Command.Setup: once fs is
// parsed, it makes the logger for process, starts tracing as service
// (tracing.Start; entry as there), and runs run, stopping the tracing when
// run returns. A bad logging or tracing flag is the command's error.
func Flags(fs *cli.FlagSet, level, process, service string, entry bool) func(run Run) func(context.Context) error {
	logger := logging.Flags(fs, level, process)
	tracer := tracing.Flags(fs)
	return func(run Run) func(context.Context) error {
		return func(ctx context.Context) error {
			log, err := logger()
			if err != nil {
				return err
			}
			stopTracing, err := tracing.Start(ctx, tracer(), service, entry, log)
			if err != nil {
				return err
			}
			defer stopTracing()
			return run(ctx, log)
		}
	}
}
