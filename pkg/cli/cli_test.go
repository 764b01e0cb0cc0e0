package cli_test

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/pkg/cli"
)

type flags struct {
	str  *string
	b    *bool
	i    *int
	d    *time.Duration
	list *[]string
}

func newFlags() (*cli.FlagSet, flags) {
	fs := cli.New("prog serve", "Serves things.")
	fs.SetOutput(io.Discard)
	return fs, flags{
		str:  fs.String("addr", "VM_X_ADDR", ":8080", "listen address"),
		b:    fs.Bool("debug", "VM_X_DEBUG", false, "debug logging"),
		i:    fs.Int("workers", "VM_X_INT", 4, "worker count"),
		d:    fs.Duration("timeout", "VM_X_TIMEOUT", 30*time.Second, "request timeout"),
		list: fs.StringList("peers", "VM_X_PEERS", []string{"a", "b"}, "peer list"),
	}
}

func envOf(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

func TestDefaults(t *testing.T) {
	fs, f := newFlags()
	if err := fs.Parse(nil, envOf(nil)); err != nil {
		t.Fatal(err)
	}
	if *f.str != ":8080" || *f.b || *f.i != 4 || *f.d != 30*time.Second || !reflect.DeepEqual(*f.list, []string{"a", "b"}) {
		t.Errorf("defaults = %q %v %d %v %q", *f.str, *f.b, *f.i, *f.d, *f.list)
	}
}

func TestEnvFillsUnsetFlags(t *testing.T) {
	fs, f := newFlags()
	env := map[string]string{
		"VM_X_ADDR":    "unix:/run/x.sock",
		"VM_X_DEBUG":   "true",
		"VM_X_INT":     "17",
		"VM_X_TIMEOUT": "1m30s",
		"VM_X_PEERS":   " p1, ,p2 ,p3",
	}
	if err := fs.Parse(nil, envOf(env)); err != nil {
		t.Fatal(err)
	}
	if *f.str != "unix:/run/x.sock" {
		t.Errorf("addr = %q", *f.str)
	}
	if !*f.b {
		t.Errorf("debug = false")
	}
	if *f.i != 17 {
		t.Errorf("workers = %d", *f.i)
	}
	if *f.d != 90*time.Second {
		t.Errorf("timeout = %v", *f.d)
	}
	if !reflect.DeepEqual(*f.list, []string{"p1", "p2", "p3"}) {
		t.Errorf("peers = %q", *f.list)
	}
}

func TestFlagWinsOverEnv(t *testing.T) {
	fs, f := newFlags()
	env := map[string]string{
		"VM_X_ADDR":    "from-env",
		"VM_X_DEBUG":   "true",
		"VM_X_INT":     "17",
		"VM_X_TIMEOUT": "1m",
		"VM_X_PEERS":   "e1,e2",
	}
	args := []string{"--addr", "from-flag", "--debug=false", "--workers=2", "--timeout", "5s", "--peers", "f1"}
	if err := fs.Parse(args, envOf(env)); err != nil {
		t.Fatal(err)
	}
	if *f.str != "from-flag" || *f.b || *f.i != 2 || *f.d != 5*time.Second || !reflect.DeepEqual(*f.list, []string{"f1"}) {
		t.Errorf("got %q %v %d %v %q", *f.str, *f.b, *f.i, *f.d, *f.list)
	}
}

func TestFlagWinsEvenWhenEnvIsInvalid(t *testing.T) {
	// The env var of a flag given on the command line is never read.
	fs, f := newFlags()
	if err := fs.Parse([]string{"--workers=3"}, envOf(map[string]string{"VM_X_INT": "abc"})); err != nil {
		t.Fatalf("Parse: %v", err)
	}
	if *f.i != 3 {
		t.Errorf("workers = %d", *f.i)
	}
}

func TestPartialEnv(t *testing.T) {
	fs, f := newFlags()
	if err := fs.Parse([]string{"--addr=x"}, envOf(map[string]string{"VM_X_INT": "9"})); err != nil {
		t.Fatal(err)
	}
	if *f.str != "x" || *f.i != 9 || *f.d != 30*time.Second {
		t.Errorf("got %q %d %v", *f.str, *f.i, *f.d)
	}
}

func TestEmptyEnvMeansDefault(t *testing.T) {
	fs, f := newFlags()
	env := map[string]string{"VM_X_ADDR": "", "VM_X_INT": "", "VM_X_DEBUG": "", "VM_X_TIMEOUT": "", "VM_X_PEERS": ""}
	if err := fs.Parse(nil, envOf(env)); err != nil {
		t.Fatal(err)
	}
	if *f.str != ":8080" || *f.b || *f.i != 4 || *f.d != 30*time.Second || !reflect.DeepEqual(*f.list, []string{"a", "b"}) {
		t.Errorf("got %q %v %d %v %q", *f.str, *f.b, *f.i, *f.d, *f.list)
	}
}

func TestInvalidEnv(t *testing.T) {
	cases := []struct {
		env, val, flag string
	}{
		{"VM_X_INT", "abc", "workers"},
		{"VM_X_DEBUG", "maybe", "debug"},
		{"VM_X_TIMEOUT", "10", "timeout"},
	}
	for _, c := range cases {
		fs, _ := newFlags()
		err := fs.Parse(nil, envOf(map[string]string{c.env: c.val}))
		if err == nil {
			t.Errorf("%s=%s: no error", c.env, c.val)
			continue
		}
		msg := err.Error()
		if !strings.Contains(msg, c.env) || !strings.Contains(msg, "--"+c.flag) || !strings.Contains(msg, c.val) {
			t.Errorf("%s=%s: error %q does not name the variable, flag and value", c.env, c.val, msg)
		}
	}
	// Two bad variables are both reported.
	fs, _ := newFlags()
	err := fs.Parse(nil, envOf(map[string]string{"VM_X_INT": "abc", "VM_X_TIMEOUT": "soon"}))
	if err == nil || !strings.Contains(err.Error(), "VM_X_INT") || !strings.Contains(err.Error(), "VM_X_TIMEOUT") {
		t.Errorf("two bad vars: %v", err)
	}
}

func TestExtraArgs(t *testing.T) {
	fs, _ := newFlags()
	err := fs.Parse([]string{"--workers=1", "stray", "more"}, envOf(nil))
	if err == nil || !strings.Contains(err.Error(), "stray more") {
		t.Fatalf("err = %v, want unexpected arguments naming them", err)
	}
}

func TestUnknownFlag(t *testing.T) {
	fs, _ := newFlags()
	if err := fs.Parse([]string{"--nope"}, envOf(nil)); err == nil {
		t.Fatal("unknown flag accepted")
	}
}

func TestHelpFlag(t *testing.T) {
	fs, _ := newFlags()
	var buf bytes.Buffer
	fs.SetOutput(&buf)
	err := fs.Parse([]string{"--help"}, envOf(nil))
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("err = %v, want flag.ErrHelp", err)
	}
	if !strings.Contains(buf.String(), "$VM_X_TIMEOUT") {
		t.Errorf("--help output lacks env names:\n%s", buf.String())
	}
}

func TestPrintUsage(t *testing.T) {
	fs, _ := newFlags()
	fs.String("empty", "VM_X_EMPTY", "", "no default")
	var buf bytes.Buffer
	fs.PrintUsage(&buf)
	out := buf.String()
	for _, want := range []string{
		"Usage: prog serve [flags]",
		"Serves things.",
		"$VM_X_ADDR", "(default :8080)",
		"$VM_X_DEBUG", "(default false)",
		"$VM_X_INT", "(default 4)",
		"$VM_X_TIMEOUT", "(default 30s)",
		"$VM_X_PEERS", "(default a,b)",
		"$VM_X_EMPTY",
		"--workers", "worker count",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("usage lacks %q:\n%s", want, out)
		}
	}
	// Flags are listed sorted by name, one per line, each with its own env var.
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var flagLines []string
	for _, l := range lines {
		if strings.HasPrefix(l, "  --") {
			flagLines = append(flagLines, l)
		}
	}
	wantOrder := []string{"addr", "debug", "empty", "peers", "timeout", "workers"}
	if len(flagLines) != len(wantOrder) {
		t.Fatalf("flag lines = %d, want %d:\n%s", len(flagLines), len(wantOrder), out)
	}
	for i, name := range wantOrder {
		if !strings.HasPrefix(flagLines[i], "  --"+name+" ") {
			t.Errorf("line %d = %q, want flag --%s", i, flagLines[i], name)
		}
	}
	if !strings.Contains(flagLines[2], "$VM_X_EMPTY") || !strings.Contains(flagLines[2], "no default") {
		t.Errorf("empty line = %q", flagLines[2])
	}
	if !strings.Contains(flagLines[5], "$VM_X_INT") {
		t.Errorf("workers line = %q", flagLines[5])
	}
	if fs.Env("workers") != "VM_X_INT" {
		t.Errorf("Env(workers) = %q", fs.Env("workers"))
	}
}

func serveCmd(ran *bool, gotAddr *string, runErr error) cli.Command {
	return cli.Command{
		Name:  "serve",
		Usage: "run the server",
		Setup: func(fs *cli.FlagSet) func(context.Context) error {
			addr := fs.String("listen", "VM_TEST_LISTEN", "unix:/run/test.sock", "where to listen")
			fs.Duration("grace", "VM_TEST_GRACE", 5*time.Second, "shutdown grace")
			return func(ctx context.Context) error {
				*ran = true
				*gotAddr = *addr
				return runErr
			}
		},
	}
}

func TestMainVersion(t *testing.T) {
	var stderr bytes.Buffer
	var ran bool
	var addr string
	if code := cli.Main("vmtest", "about", []string{"version"}, &stderr, serveCmd(&ran, &addr, nil)); code != 0 {
		t.Errorf("version exit = %d", code)
	}
	if ran {
		t.Error("version ran serve")
	}
}

func TestMainUnknownCommand(t *testing.T) {
	var stderr bytes.Buffer
	var ran bool
	var addr string
	code := cli.Main("vmtest", "about", []string{"frobnicate"}, &stderr, serveCmd(&ran, &addr, nil))
	if code != 2 {
		t.Errorf("exit = %d, want 2", code)
	}
	if !strings.Contains(stderr.String(), `unknown command "frobnicate"`) || !strings.Contains(stderr.String(), "vmtest serve [flags]") {
		t.Errorf("stderr = %q", stderr.String())
	}
}

func TestMainNoArgs(t *testing.T) {
	var stderr bytes.Buffer
	var ran bool
	var addr string
	if code := cli.Main("vmtest", "about", nil, &stderr, serveCmd(&ran, &addr, nil)); code != 2 {
		t.Errorf("exit = %d, want 2", code)
	}
	if !strings.Contains(stderr.String(), "vmtest: about") {
		t.Errorf("stderr = %q", stderr.String())
	}
}

func TestMainHelp(t *testing.T) {
	var stderr bytes.Buffer
	if code := cli.Main("vmtest", "about", []string{"help"}, &stderr); code != 0 {
		t.Errorf("help exit = %d", code)
	}
}

func TestMainServeHelp(t *testing.T) {
	var stderr bytes.Buffer
	var ran bool
	var addr string
	code := cli.Main("vmtest", "about", []string{"serve", "--help"}, &stderr, serveCmd(&ran, &addr, nil))
	if code != 0 {
		t.Errorf("exit = %d, want 0", code)
	}
	if ran {
		t.Error("serve --help ran the command")
	}
	out := stderr.String()
	for _, want := range []string{"Usage: vmtest serve [flags]", "$VM_TEST_LISTEN", "$VM_TEST_GRACE", "(default unix:/run/test.sock)", "(default 5s)"} {
		if !strings.Contains(out, want) {
			t.Errorf("stderr lacks %q:\n%s", want, out)
		}
	}
}

func TestMainRunsCommand(t *testing.T) {
	t.Setenv("VM_TEST_LISTEN", "unix:/from/env.sock")
	var stderr bytes.Buffer
	var ran bool
	var addr string
	if code := cli.Main("vmtest", "about", []string{"serve"}, &stderr, serveCmd(&ran, &addr, nil)); code != 0 {
		t.Fatalf("exit = %d, stderr %q", code, stderr.String())
	}
	if !ran || addr != "unix:/from/env.sock" {
		t.Errorf("ran=%v addr=%q", ran, addr)
	}

	ran, addr = false, ""
	if code := cli.Main("vmtest", "about", []string{"serve", "--listen=flag"}, &stderr, serveCmd(&ran, &addr, nil)); code != 0 {
		t.Fatalf("exit = %d", code)
	}
	if addr != "flag" {
		t.Errorf("addr = %q, want flag", addr)
	}
}

func TestMainRunErrorAndBadEnv(t *testing.T) {
	var stderr bytes.Buffer
	var ran bool
	var addr string
	code := cli.Main("vmtest", "about", []string{"serve"}, &stderr, serveCmd(&ran, &addr, errors.New("boom")))
	if code != 1 {
		t.Errorf("run error exit = %d, want 1", code)
	}
	if !strings.Contains(stderr.String(), "vmtest serve: boom") {
		t.Errorf("stderr = %q", stderr.String())
	}

	t.Setenv("VM_TEST_GRACE", "forever")
	stderr.Reset()
	ran = false
	code = cli.Main("vmtest", "about", []string{"serve"}, &stderr, serveCmd(&ran, &addr, nil))
	if code != 2 {
		t.Errorf("bad env exit = %d, want 2", code)
	}
	if ran {
		t.Error("command ran despite bad env")
	}
	if !strings.Contains(stderr.String(), "VM_TEST_GRACE") {
		t.Errorf("stderr = %q", stderr.String())
	}

	stderr.Reset()
	code = cli.Main("vmtest", "about", []string{"serve", "--grace=1s", "extra"}, &stderr, serveCmd(&ran, &addr, nil))
	if code != 2 || !strings.Contains(stderr.String(), "unexpected arguments: extra") {
		t.Errorf("extra arg exit = %d, stderr %q", code, stderr.String())
	}
}
