// Package buildinfo carries the version stamped in by the Makefile's -ldflags.
package buildinfo

import "runtime/debug"

// Set with -ldflags "-X github.com/giantswarm/vm-manager/pkg/buildinfo.Version=…".
var (
	Version = "dev"
	Commit  = ""
)

// CommitOrVCS returns Commit, else the vcs.revision the go tool recorded.
func CommitOrVCS() string {
	if Commit != "" {
		return Commit
	}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" && len(s.Value) >= 7 {
				return s.Value[:7]
			}
		}
	}
	return "unknown"
}
