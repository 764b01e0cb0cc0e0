package main

import (
	"bytes"
	"debug/elf"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

var moduleExts = []string{".ko.xz", ".ko.zst", ".ko.gz", ".ko"}

func isModuleFile(name string) bool {
	for _, ext := range moduleExts {
		if strings.HasSuffix(name, ext) {
			return true
		}
	}
	return false
}

// moduleName normalizes like the kernel: file "virtio-rng.ko" is module virtio_rng.
func moduleName(s string) string {
	s = filepath.Base(s)
	for _, ext := range moduleExts {
		s = strings.TrimSuffix(s, ext)
	}
	return strings.ReplaceAll(s, "-", "_")
}

// module is one .ko file found on disk.
type module struct {
	name string
	path string
}

// findModules indexes the .ko files named by spec: a directory searched recursively
// (e.g. lib/modules/<kver>), or a comma-separated list of files.
func findModules(spec string) (map[string]module, map[string]bool, error) {
	index := map[string]module{}
	builtin := map[string]bool{}
	add := func(p string) error {
		if strings.HasSuffix(p, ".ko.xz") || strings.HasSuffix(p, ".ko.zst") || strings.HasSuffix(p, ".ko.gz") {
			return fmt.Errorf("%s: compressed module; decompress it first (the kernel's finit_module here takes plain .ko)", p)
		}
		n := moduleName(p)
		if old, dup := index[n]; dup && old.path != p {
			return fmt.Errorf("module %s found twice: %s and %s", n, old.path, p)
		}
		index[n] = module{name: n, path: p}
		return nil
	}
	if st, err := os.Stat(spec); err == nil && st.IsDir() {
		err := filepath.WalkDir(spec, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if !d.IsDir() && isModuleFile(d.Name()) {
				return add(p)
			}
			return nil
		})
		if err != nil {
			return nil, nil, err
		}
		// Built-in modules satisfy dependencies without a file.
		if b, err := os.ReadFile(filepath.Join(spec, "modules.builtin")); err == nil {
			for _, l := range strings.Fields(string(b)) {
				builtin[moduleName(l)] = true
			}
		}
		return index, builtin, nil
	}
	for _, p := range strings.Split(spec, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		if _, err := os.Stat(p); err != nil {
			return nil, nil, err
		}
		if err := add(p); err != nil {
			return nil, nil, err
		}
	}
	return index, builtin, nil
}

// modinfoDepends returns the depends= list of a module's .modinfo section.
func modinfoDepends(path string) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	defer f.Close()
	sec := f.Section(".modinfo")
	if sec == nil {
		return nil, fmt.Errorf("%s: no .modinfo section", path)
	}
	data, err := sec.Data()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	var deps []string
	for _, kv := range bytes.Split(data, []byte{0}) {
		if v, ok := bytes.CutPrefix(kv, []byte("depends=")); ok {
			for _, d := range strings.Split(string(v), ",") {
				if d != "" {
					deps = append(deps, moduleName(d))
				}
			}
		}
	}
	return deps, nil
}

// resolveOrder returns the modules to load, dependencies first, keeping the requested
// order otherwise. Built-in dependencies are skipped; missing ones are errors.
func resolveOrder(want []string, index map[string]module, builtin map[string]bool, depends func(string) ([]string, error)) ([]module, error) {
	if len(want) == 0 {
		for n := range index {
			want = append(want, n)
		}
		sort.Strings(want)
	}
	var order []module
	state := map[string]int{} // 1 visiting, 2 done
	var visit func(n, from string) error
	visit = func(n, from string) error {
		switch state[n] {
		case 1:
			return fmt.Errorf("module dependency cycle at %s", n)
		case 2:
			return nil
		}
		m, ok := index[n]
		if !ok {
			if builtin[n] {
				state[n] = 2
				return nil
			}
			if from != "" {
				return fmt.Errorf("module %s (needed by %s) not found", n, from)
			}
			return fmt.Errorf("module %s not found", n)
		}
		state[n] = 1
		deps, err := depends(m.path)
		if err != nil {
			return err
		}
		for _, d := range deps {
			if err := visit(d, n); err != nil {
				return err
			}
		}
		state[n] = 2
		order = append(order, m)
		return nil
	}
	for _, n := range want {
		if err := visit(moduleName(n), ""); err != nil {
			return nil, err
		}
	}
	return order, nil
}
