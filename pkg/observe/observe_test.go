package observe_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"

	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/pkg/observe"
	"github.com/giantswarm/vm-manager/pkg/tracing"
)

func TestFlagsRunsWithTheLogger(t *testing.T) {
	fs := cli.New("x serve", "")
	serve := observe.Flags(fs, "warn", "x", tracing.Hypervisor, false)
	want := errors.New("done")
	var got *slog.Logger
	run := serve(func(ctx context.Context, log *slog.Logger) error {
		got = log
		return want
	})
	for _, name := range []string{"log-format", "log-level"} {
		if fs.Lookup(name) == nil {
			t.Fatalf("--%s not defined", name)
		}
	}
	if err := fs.Parse([]string{"--log-format=json"}, func(string) string { return "" }); err != nil {
		t.Fatal(err)
	}
	if err := run(context.Background()); err != want {
		t.Fatalf("run: %v, want run's error", err)
	}
	if got == nil || got.Enabled(context.Background(), slog.LevelInfo) || !got.Enabled(context.Background(), slog.LevelWarn) {
		t.Fatalf("run got logger %v, want one at level warn", got)
	}
}

func TestBadLogFlagIsTheError(t *testing.T) {
	fs := cli.New("x serve", "")
	serve := observe.Flags(fs, "info", "x", tracing.Hypervisor, false)
	ran := false
	run := serve(func(context.Context, *slog.Logger) error { ran = true; return nil })
	if err := fs.Parse([]string{"--log-level=loud"}, func(string) string { return "" }); err != nil {
		t.Fatal(err)
	}
	if err := run(context.Background()); err == nil || ran {
		t.Fatalf("run: %v (ran %v), want the log level's error without running", err, ran)
	}
}
