package main

import (
	"debug/pe"
	"encoding/hex"
	"errors"
	"fmt"
	"os"

	"github.com/giantswarm/vm-manager/pkg/measure"
)

// policyOf writes the policy of a UKI that another tool built (c.uki). The
// EFI applications its boot starts (uki.authenticode) are the loader in
// front of it, when given, the UKI and its kernel.
func policyOf(c config) error {
	if c.policy == "" {
		return errors.New("-uki needs -policy")
	}
	digests, linux, err := measuredSections(c.uki)
	if err != nil {
		return err
	}
	files := map[string][]byte{"linux": linux}
	if c.loader != "" {
		b, err := os.ReadFile(c.loader)
		if err != nil {
			return err
		}
		files["loader"] = b
	}
	apps := map[string]string{}
	for key, b := range files {
		d, err := measure.Authenticode(b)
		if err != nil {
			return fmt.Errorf("%s: %s: %w", c.uki, key, err)
		}
		apps[key] = hex.EncodeToString(d)
	}
	b, err := os.ReadFile(c.uki)
	if err != nil {
		return err
	}
	d, err := measure.Authenticode(b)
	if err != nil {
		return fmt.Errorf("%s: %w", c.uki, err)
	}
	apps["uki"] = hex.EncodeToString(d)
	return writePolicy(c, digests, apps)
}

// measuredSections hashes each section systemd-stub measures (measure.Sections)
// as the stub sees it in memory: VirtualSize bytes, the part past the raw
// data being zeros. It also returns the .linux section, the kernel the stub
// starts.
func measuredSections(path string) (map[string][]byte, []byte, error) {
	f, err := pe.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	out := map[string][]byte{}
	var linux []byte
	for _, name := range measure.Sections {
		s := f.Section(name)
		if s == nil {
			continue
		}
		raw, err := s.Data()
		if err != nil {
			return nil, nil, fmt.Errorf("%s: section %s: %w", path, name, err)
		}
		mem := make([]byte, s.VirtualSize)
		copy(mem, raw)
		out[name] = measure.Digest(mem)
		if name == ".linux" {
			linux = mem
		}
	}
	for _, name := range []string{".linux", ".osrel", ".cmdline", ".initrd"} {
		if _, ok := out[name]; !ok {
			return nil, nil, fmt.Errorf("%s: no %s section", path, name)
		}
	}
	return out, linux, nil
}
