// Package sysext fetches the VM's Kubernetes system extension from the IMDS,
// measures it into PCR 13 and merges it only if it is the one SHA256SUMS
// lists: a read-only erofs image loop-mounted under /run/extensions.
package sysext

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/giantswarm/vm-manager/guest/internal/imdsclient"
	"github.com/giantswarm/vm-manager/pkg/measure"
)

// Component is the sysupdate component the extension comes from.
const Component = "kubernetes"

// Defaults: where extensions go, and the bounds on what the host may send.
const (
	DefaultDir      = "/run/extensions"
	DefaultMaxBytes = 512 << 20
	maxSumsBytes    = 1 << 20
)

// States of a Result.
const (
	StateNone     = "none"     // no /kubernetes-version: nothing to do
	StateMerged   = "merged"   // measured and mounted
	StateMismatch = "mismatch" // measured, but not the image SHA256SUMS lists: not merged
	StateRefused  = "refused"  // larger than the bound: not kept, not measured
	StateFailed   = "failed"   // any other error: not merged
)

// Measurer extends a word into a PCR and logs it (pcrextend.Extender).
type Measurer interface {
	Extend(pcr uint32, word, eventType string) ([]string, error)
}

// Merger mounts an extension image read-only at dir, and undoes it.
type Merger interface {
	Merge(image, dir string) error
	Unmerge(dir string) error
}

// Config is one run.
type Config struct {
	IMDS     *imdsclient.Client
	Measure  Measurer
	Merge    Merger
	Dir      string // DefaultDir when empty
	MaxBytes int64  // DefaultMaxBytes when 0
	Logf     func(format string, args ...any)
}

// Result is what Run did; Version is empty when the VM has none.
type Result struct {
	Version   string
	State     string
	SHA256    string // of the bytes fetched (what PCR 13 holds)
	Listed    string // what SHA256SUMS lists
	VersionID string // from the merged extension's extension-release
}

// versionRE keeps a version a plain file-name element.
var versionRE = regexp.MustCompile(`^[0-9A-Za-z][0-9A-Za-z._+-]{0,63}$`)

// Run fetches, measures and merges the extension of /kubernetes-version. It
// never returns an error: how it ended is the Result, and Logf says why.
func Run(ctx context.Context, c Config) Result {
	if c.Dir == "" {
		c.Dir = DefaultDir
	}
	if c.MaxBytes <= 0 {
		c.MaxBytes = DefaultMaxBytes
	}
	if c.Logf == nil {
		c.Logf = func(string, ...any) {}
	}
	v, err := c.IMDS.KubernetesVersion(ctx)
	switch {
	case errors.Is(err, imdsclient.ErrNotFound):
		c.Logf("no kubernetes version (404): no system extension")
		return Result{State: StateNone}
	case err != nil:
		c.Logf("sysext: kubernetes version: %v", err)
		return Result{State: StateFailed}
	case !versionRE.MatchString(v):
		c.Logf("sysext: kubernetes version %q is not a version", imdsclient.Snippet([]byte(v)))
		return Result{State: StateFailed}
	}
	res := Result{Version: v}
	res.State, err = c.run(ctx, &res)
	if err != nil {
		c.Logf("sysext %s: %v", measure.SysextFile(v), err)
	}
	return res
}

func (c *Config) run(ctx context.Context, res *Result) (string, error) {
	file := measure.SysextFile(res.Version)
	var sums bytes.Buffer
	if _, err := c.IMDS.SysupdateFile(ctx, Component, "SHA256SUMS", &sums, maxSumsBytes); err != nil {
		return StateFailed, fmt.Errorf("SHA256SUMS: %w", err)
	}
	listed, err := Lookup(sums.Bytes(), file)
	if err != nil {
		return StateFailed, err
	}
	res.Listed = listed

	if err := os.MkdirAll(c.Dir, 0o755); err != nil {
		return StateFailed, err
	}
	part := filepath.Join(c.Dir, "."+file+".part")
	sum, n, err := c.fetch(ctx, file, part)
	var tl *imdsclient.TooLargeError
	switch {
	case errors.As(err, &tl):
		os.Remove(part)
		return StateRefused, fmt.Errorf("refused: larger than the %s bound", bytesString(tl.Max))
	case err != nil:
		os.Remove(part)
		return StateFailed, err
	}
	res.SHA256 = sum
	c.Logf("sysext: fetched %s (%d bytes, sha256 %s)", file, n, sum)

	// Measure before use, what was fetched rather than what was listed: a
	// wrong image then shows in PCR 13 even though it is not merged.
	line := measure.SysextLine(sum, file)
	for _, ev := range []struct{ word, typ string }{{measure.WordOSSeparator, measure.EventTypeOSSeparator}, {line, measure.EventTypeSysext}} {
		banks, err := c.Measure.Extend(measure.PCRSysext, ev.word, ev.typ)
		if err != nil {
			os.Remove(part)
			return StateFailed, fmt.Errorf("not merged: measuring %q into PCR %d: %w", ev.word, measure.PCRSysext, err)
		}
		c.Logf("sysext: %q extended into PCR %d (%s)", ev.word, measure.PCRSysext, strings.Join(banks, ", "))
	}
	if sum != listed {
		os.Remove(part)
		return StateMismatch, fmt.Errorf("not merged: fetched sha256 %s, SHA256SUMS lists %s", sum, listed)
	}

	image := filepath.Join(c.Dir, file)
	if err := os.Rename(part, image); err != nil {
		os.Remove(part)
		return StateFailed, err
	}
	mnt := filepath.Join(c.Dir, strings.TrimSuffix(file, ".raw"))
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		return StateFailed, err
	}
	if err := c.Merge.Merge(image, mnt); err != nil {
		return StateFailed, fmt.Errorf("not merged: %w", err)
	}
	name := strings.TrimSuffix(file, ".raw")
	rel, err := os.ReadFile(filepath.Join(mnt, "usr/lib/extension-release.d", "extension-release."+name))
	if err != nil {
		_ = c.Merge.Unmerge(mnt)
		return StateFailed, fmt.Errorf("not a system extension, unmounted: %w", err)
	}
	res.VersionID = osReleaseValue(rel, "VERSION_ID")
	c.Logf("sysext %s merged (VERSION_ID=%s)", file, res.VersionID)
	if res.VersionID != res.Version {
		c.Logf("warning: sysext %s says VERSION_ID=%s, not %s", file, res.VersionID, res.Version)
	}
	return StateMerged, nil
}

// fetch streams the file to path, hashing what it writes.
func (c *Config) fetch(ctx context.Context, file, path string) (string, int64, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
	if err != nil {
		return "", 0, err
	}
	h := sha256.New()
	n, err := c.IMDS.SysupdateFile(ctx, Component, file, io.MultiWriter(f, h), c.MaxBytes)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", n, err
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

// Lookup finds file's sha256 in a sha256sum listing ("<hex>  <file>", or
// "<hex> *<file>" in binary mode).
func Lookup(sums []byte, file string) (string, error) {
	sc := bufio.NewScanner(bytes.NewReader(sums))
	for sc.Scan() {
		sum, name, ok := strings.Cut(strings.TrimSpace(sc.Text()), " ")
		if !ok {
			continue
		}
		name = strings.TrimPrefix(strings.TrimLeft(name, " "), "*")
		if name != file {
			continue
		}
		if b, err := hex.DecodeString(sum); err != nil || len(b) != sha256.Size {
			return "", fmt.Errorf("SHA256SUMS: the line for %s has no sha256", file)
		}
		return strings.ToLower(sum), nil
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("SHA256SUMS: %w", err)
	}
	return "", fmt.Errorf("SHA256SUMS lists no %s", file)
}

func bytesString(n int64) string {
	if n >= 1<<20 && n%(1<<20) == 0 {
		return fmt.Sprintf("%d MiB", n>>20)
	}
	return fmt.Sprintf("%d-byte", n)
}

// osReleaseValue reads KEY=value (optionally quoted) from an os-release file.
func osReleaseValue(b []byte, key string) string {
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), key+"="); ok {
			return strings.Trim(v, `"'`)
		}
	}
	return ""
}
