// Package ignition applies the subset of an Ignition config the test guest needs:
// storage.files with inline data: URLs, a mode and a path. Everything else in the
// config is ignored (and named, so nobody wonders why a unit did not appear).
package ignition

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
)

// Config is the part of an Ignition config (spec 3.x) that is read.
type Config struct {
	Ignition struct {
		Version string `json:"version"`
	} `json:"ignition"`
	Storage struct {
		Files []File `json:"files"`
	} `json:"storage"`
}

// File is one storage.files entry.
type File struct {
	Path     string `json:"path"`
	Mode     *int   `json:"mode"` // decimal in JSON (420 = 0644); default 0644
	Contents struct {
		Source      *string `json:"source"`
		Compression string  `json:"compression"`
	} `json:"contents"`
}

// Parse reads a config and names the top-level and storage sections it ignores.
func Parse(b []byte) (*Config, []string, error) {
	var c Config
	if err := json.Unmarshal(b, &c); err != nil {
		return nil, nil, fmt.Errorf("not an Ignition config: %w", err)
	}
	if !strings.HasPrefix(c.Ignition.Version, "3.") {
		return nil, nil, fmt.Errorf("unsupported Ignition version %q (want 3.x)", c.Ignition.Version)
	}
	var raw map[string]json.RawMessage
	_ = json.Unmarshal(b, &raw)
	var ignored []string
	for k := range raw {
		if k != "ignition" && k != "storage" {
			ignored = append(ignored, k)
		}
	}
	var storage map[string]json.RawMessage
	_ = json.Unmarshal(raw["storage"], &storage)
	for k := range storage {
		if k != "files" {
			ignored = append(ignored, "storage."+k)
		}
	}
	sort.Strings(ignored)
	return &c, ignored, nil
}

// Written is one file Apply wrote.
type Written struct {
	Path string
	Mode fs.FileMode
	Size int
}

// Apply writes the files under root ("/" at boot), creating parent directories
// (0755). It stops at the first error; files written so far are returned.
func Apply(c *Config, root string) ([]Written, error) {
	var out []Written
	for i, f := range c.Storage.Files {
		w, err := writeFile(f, root)
		if err != nil {
			return out, fmt.Errorf("storage.files[%d] %s: %w", i, f.Path, err)
		}
		out = append(out, w)
	}
	return out, nil
}

func writeFile(f File, root string) (Written, error) {
	if !path.IsAbs(f.Path) {
		return Written{}, errors.New("path must be absolute")
	}
	clean := path.Clean(f.Path)
	if clean == "/" {
		return Written{}, errors.New("path is the root directory")
	}
	if f.Contents.Compression != "" {
		return Written{}, fmt.Errorf("compression %q not supported", f.Contents.Compression)
	}
	var data []byte
	if f.Contents.Source != nil {
		var err error
		if data, err = DecodeDataURL(*f.Contents.Source); err != nil {
			return Written{}, err
		}
	}
	mode := fs.FileMode(0o644)
	if f.Mode != nil {
		if *f.Mode < 0 || *f.Mode > 0o7777 {
			return Written{}, fmt.Errorf("mode %d out of range", *f.Mode)
		}
		mode = fs.FileMode(*f.Mode & 0o777)
	}
	dst := filepath.Join(root, filepath.FromSlash(clean))
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return Written{}, err
	}
	// Write then rename: a half-written file never appears under its name.
	tmp := dst + ".vm-agent-tmp"
	if err := os.WriteFile(tmp, data, mode); err != nil {
		return Written{}, err
	}
	if err := os.Chmod(tmp, mode); err != nil { // not masked by the umask
		os.Remove(tmp)
		return Written{}, err
	}
	if err := os.Rename(tmp, dst); err != nil {
		os.Remove(tmp)
		return Written{}, err
	}
	return Written{Path: clean, Mode: mode, Size: len(data)}, nil
}

// DecodeDataURL decodes an RFC 2397 data URL: data:[<mediatype>][;base64],<data>.
// Without ;base64 the data is percent-encoded. Other URL schemes are refused: the
// guest fetches nothing remote on Ignition's behalf.
func DecodeDataURL(s string) ([]byte, error) {
	rest, ok := strings.CutPrefix(s, "data:")
	if !ok {
		scheme, _, _ := strings.Cut(s, ":")
		if scheme == s {
			return nil, errors.New("contents.source is not a URL")
		}
		return nil, fmt.Errorf("contents.source scheme %q not supported (only data:)", scheme)
	}
	meta, payload, ok := strings.Cut(rest, ",")
	if !ok {
		return nil, errors.New("data URL without a comma")
	}
	isB64 := false
	for _, p := range strings.Split(meta, ";") {
		if strings.EqualFold(strings.TrimSpace(p), "base64") {
			isB64 = true
		}
	}
	dec, err := url.PathUnescape(payload) // '+' stays '+', which base64 needs
	if err != nil {
		return nil, fmt.Errorf("data URL: %w", err)
	}
	if !isB64 {
		return []byte(dec), nil
	}
	dec = strings.Map(func(r rune) rune { // whitespace is allowed and ignored
		if r == ' ' || r == '\n' || r == '\r' || r == '\t' {
			return -1
		}
		return r
	}, dec)
	b, err := base64.StdEncoding.DecodeString(dec)
	if err != nil {
		if b2, err2 := base64.RawStdEncoding.DecodeString(strings.TrimRight(dec, "=")); err2 == nil {
			return b2, nil
		}
		return nil, fmt.Errorf("data URL: base64: %w", err)
	}
	return b, nil
}
