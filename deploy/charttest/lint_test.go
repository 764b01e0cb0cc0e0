package charttest

import (
	"path/filepath"
	"testing"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chartutil"
)

// ciValues returns the chart's ci/*.yaml files.
func ciValues(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(ChartDir, "ci", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no ci/*.yaml in %s: %v", ChartDir, err)
	}
	return files
}

func lint(t *testing.T, vals map[string]any) *action.LintResult {
	t.Helper()
	kv, err := chartutil.ParseKubeVersion(KubeVersion)
	if err != nil {
		t.Fatal(err)
	}
	l := action.NewLint()
	l.Strict = true // warnings count as errors
	l.Namespace = Namespace
	l.KubeVersion = kv
	return l.Run([]string{ChartDir}, vals)
}

func logMessages(t *testing.T, res *action.LintResult) {
	t.Helper()
	for _, m := range res.Messages {
		t.Logf("lint %s: %s", m.Path, m.Error())
	}
}

// TestLint runs helm's linter (strict: a warning fails too) over the chart
// with its defaults and with each ci/*.yaml. Helm's lint reports a template's
// `fail` as information, not an error, so the defaults (which refuse to
// render an anonymous API nobody asked for; TestTemplate checks the message)
// are linted again with the opt-in, which renders every default template.
func TestLint(t *testing.T) {
	for _, f := range ciValues(t) {
		t.Run(filepath.Base(f), func(t *testing.T) {
			vals, err := chartutil.ReadValuesFile(f)
			if err != nil {
				t.Fatal(err)
			}
			res := lint(t, vals)
			logMessages(t, res)
			if res.TotalChartsLinted != 1 || len(res.Errors) > 0 {
				t.Fatalf("lint with %s: %d charts, errors %v", f, res.TotalChartsLinted, res.Errors)
			}
		})
	}
	t.Run("defaults", func(t *testing.T) {
		for _, vals := range []map[string]any{nil, {"gateway": map[string]any{"allowAnonymousNonLoopback": true}}} {
			res := lint(t, vals)
			logMessages(t, res)
			if res.TotalChartsLinted != 1 || len(res.Errors) > 0 {
				t.Fatalf("lint with %v: %d charts, errors %v", vals, res.TotalChartsLinted, res.Errors)
			}
		}
	})
}
