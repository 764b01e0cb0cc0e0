// Package logging sets up log/slog the same way in every process.
package logging

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"github.com/giantswarm/vm-manager/pkg/cli"
)

// New returns a logger writing to w in format "text" or "json" at level
// debug|info|warn|error, tagged with the process name.
func New(w io.Writer, format, level, process string) (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("log level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lvl}
	var h slog.Handler
	switch strings.ToLower(format) {
	case "text", "":
		h = slog.NewTextHandler(w, opts)
	case "json":
		h = slog.NewJSONHandler(w, opts)
	default:
		return nil, fmt.Errorf("log format %q: want text or json", format)
	}
	return slog.New(h).With("process", process), nil
}

// Flags defines --log-format ($VM_MANAGER_LOG_FORMAT, default text) and
// --log-level ($VM_MANAGER_LOG_LEVEL, default level) on fs. The function it
// returns, called once fs is parsed, is New for stderr and process.
func Flags(fs *cli.FlagSet, level, process string) func() (*slog.Logger, error) {
	format := fs.String("log-format", "VM_MANAGER_LOG_FORMAT", "text", "log format: text or json")
	lvl := fs.String("log-level", "VM_MANAGER_LOG_LEVEL", level, "log level: debug, info, warn, error")
	return func() (*slog.Logger, error) {
		return New(os.Stderr, *format, *lvl, process)
	}
}
