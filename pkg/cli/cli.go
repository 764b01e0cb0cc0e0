// Package cli gives every flag an environment fallback and shows it in --help.
//
// Precedence: a flag on the command line wins; else a set, non-empty
// environment variable; else the default. An environment value that does not
// parse is an error at start-up (the original silently used the default, which
// hides typos in deployment manifests).
package cli

import (
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"
)

// FlagSet is a flag.FlagSet whose flags each have an environment variable.
type FlagSet struct {
	*flag.FlagSet
	env   map[string]string // flag name -> env var
	usage string
}

// New returns a FlagSet for "<cmd> <sub>" with a one-line description.
func New(name, usage string) *FlagSet {
	fs := &FlagSet{FlagSet: flag.NewFlagSet(name, flag.ContinueOnError), env: map[string]string{}, usage: usage}
	fs.FlagSet.Usage = func() { fs.PrintUsage(fs.Output()) }
	return fs
}

// String defines a string flag with an environment fallback.
func (fs *FlagSet) String(name, env, def, help string) *string {
	fs.env[name] = env
	return fs.FlagSet.String(name, def, help)
}

// Bool defines a bool flag with an environment fallback.
func (fs *FlagSet) Bool(name, env string, def bool, help string) *bool {
	fs.env[name] = env
	return fs.FlagSet.Bool(name, def, help)
}

// Int defines an int flag with an environment fallback.
func (fs *FlagSet) Int(name, env string, def int, help string) *int {
	fs.env[name] = env
	return fs.FlagSet.Int(name, def, help)
}

// Duration defines a duration flag with an environment fallback.
func (fs *FlagSet) Duration(name, env string, def time.Duration, help string) *time.Duration {
	fs.env[name] = env
	return fs.FlagSet.Duration(name, def, help)
}

// StringList defines a comma-separated list flag with an environment fallback.
func (fs *FlagSet) StringList(name, env string, def []string, help string) *[]string {
	fs.env[name] = env
	v := &listValue{list: append([]string(nil), def...)}
	fs.FlagSet.Var(v, name, help)
	return &v.list
}

type listValue struct{ list []string }

func (l *listValue) String() string { return strings.Join(l.list, ",") }
func (l *listValue) Set(s string) error {
	l.list = nil
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			l.list = append(l.list, p)
		}
	}
	return nil
}

// Parse parses args, then fills every flag not given on the command line from
// its environment variable (looked up with getenv; nil means os.Getenv).
func (fs *FlagSet) Parse(args []string, getenv func(string) string) error {
	if getenv == nil {
		getenv = os.Getenv
	}
	if err := fs.FlagSet.Parse(args); err != nil {
		return err
	}
	set := map[string]bool{}
	fs.FlagSet.Visit(func(f *flag.Flag) { set[f.Name] = true })
	var errs []string
	fs.FlagSet.VisitAll(func(f *flag.Flag) {
		env := fs.env[f.Name]
		if set[f.Name] || env == "" {
			return
		}
		if v := getenv(env); v != "" {
			if err := f.Value.Set(v); err != nil {
				errs = append(errs, fmt.Sprintf("%s=%q (for --%s): %v", env, v, f.Name, err))
			}
		}
	})
	if len(errs) > 0 {
		return fmt.Errorf("invalid environment: %s", strings.Join(errs, "; "))
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %s", strings.Join(fs.Args(), " "))
	}
	return nil
}

// PrintUsage writes the description and every flag with its variable and default.
func (fs *FlagSet) PrintUsage(w io.Writer) {
	fmt.Fprintf(w, "Usage: %s [flags]\n\n%s\n\nFlags (a flag wins over its environment variable):\n", fs.Name(), fs.usage)
	var flags []*flag.Flag
	fs.FlagSet.VisitAll(func(f *flag.Flag) { flags = append(flags, f) })
	sort.Slice(flags, func(i, j int) bool { return flags[i].Name < flags[j].Name })
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	for _, f := range flags {
		help := f.Usage
		if f.DefValue != "" && !strings.Contains(help, "(default") {
			help += " (default " + f.DefValue + ")"
		}
		fmt.Fprintf(tw, "  --%s\t$%s\t%s\n", f.Name, fs.env[f.Name], help)
	}
	tw.Flush()
}

// Env returns the environment variable of a flag, for documentation tests.
func (fs *FlagSet) Env(name string) string { return fs.env[name] }
