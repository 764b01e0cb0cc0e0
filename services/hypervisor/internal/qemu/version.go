package qemu

import (
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
)

// Version is a QEMU release. The argv depends on it where options were
// renamed or added.
type Version struct {
	Major, Minor, Micro int
}

func (v Version) String() string { return fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Micro) }

// AtLeast reports whether v is major.minor or newer.
func (v Version) AtLeast(major, minor int) bool {
	return v.Major > major || v.Major == major && v.Minor >= minor
}

var versionRE = regexp.MustCompile(`version (\d+)\.(\d+)(?:\.(\d+))?`)

// ParseVersion reads the output of `qemu-system-x86_64 --version`
// ("QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18)").
func ParseVersion(out string) (Version, error) {
	m := versionRE.FindStringSubmatch(out)
	if m == nil {
		return Version{}, fmt.Errorf("no QEMU version in %q", firstLine(out))
	}
	var v Version
	v.Major, _ = strconv.Atoi(m[1])
	v.Minor, _ = strconv.Atoi(m[2])
	if m[3] != "" {
		v.Micro, _ = strconv.Atoi(m[3])
	}
	return v, nil
}

// ProbeVersion runs `<binary> --version`.
func ProbeVersion(ctx context.Context, binary string) (Version, error) {
	out, err := exec.CommandContext(ctx, binary, "--version").Output()
	if err != nil {
		return Version{}, fmt.Errorf("%s --version: %w", binary, err)
	}
	return ParseVersion(string(out))
}

func firstLine(s string) string {
	for i := 0; i < len(s); i++ {
		if s[i] == '\n' {
			return s[:i]
		}
	}
	return s
}
