package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
)

// inputs is the *.json files below dir, sorted. Its walk starts like
// guestimage.Files' (services/hypervisor); kept apart: another module, and
// another filter and form of the names.
func inputs(dir string) ([]string, error) {
	var files []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() && strings.HasSuffix(p, ".json") {
			files = append(files, p)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	if len(files) == 0 {
		return nil, fmt.Errorf("no *.json under %s", dir)
	}
	sort.Strings(files)
	return files, nil
}

func readJSON(name string) (obj, error) {
	b, err := os.ReadFile(name)
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber() // numbers pass through unchanged
	var doc obj
	if err := dec.Decode(&doc); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if v, _ := doc["openapi"].(string); !strings.HasPrefix(v, "3.1.") {
		return nil, fmt.Errorf("%s: openapi %q, want 3.1.x", name, v)
	}
	return doc, nil
}

func merge(dst, src obj) error {
	for _, k := range sortedKeys(src) {
		v := src[k]
		switch k {
		case "openapi", "info": // replaced by vm-manager's own
		case "paths":
			if err := mergePaths(dst["paths"].(obj), asObj(v)); err != nil {
				return err
			}
		case "components":
			comps := dst["components"].(obj)
			for _, section := range sortedKeys(asObj(v)) {
				if comps[section] == nil {
					comps[section] = obj{}
				}
				if err := union(asObj(comps[section]), asObj(asObj(v)[section]), "components."+section); err != nil {
					return err
				}
			}
		case "tags":
			tags, err := mergeTags(dst["tags"].([]any), v)
			if err != nil {
				return err
			}
			dst["tags"] = tags
		default:
			if old, ok := dst[k]; ok && !reflect.DeepEqual(old, v) {
				return fmt.Errorf("%s differs between inputs", k)
			}
			dst[k] = v
		}
	}
	return nil
}

func mergePaths(dst, src obj) error {
	for _, path := range sortedKeys(src) {
		item := asObj(src[path])
		if dst[path] == nil {
			dst[path] = obj{}
		}
		have := asObj(dst[path])
		for _, k := range sortedKeys(item) {
			old, ok := have[k]
			switch {
			case !ok:
				have[k] = item[k]
			case slices.Contains(httpMethods, k):
				return fmt.Errorf("%s %s is defined twice", strings.ToUpper(k), path)
			case !reflect.DeepEqual(old, item[k]):
				return fmt.Errorf("path %s: %s differs between inputs", path, k)
			}
		}
	}
	return nil
}

// union adds src's entries to dst; the same name must mean the same thing.
func union(dst, src obj, what string) error {
	for _, name := range sortedKeys(src) {
		if old, ok := dst[name]; ok && !reflect.DeepEqual(old, src[name]) {
			return fmt.Errorf("%s: conflicting definitions of %s", what, name)
		}
		dst[name] = src[name]
	}
	return nil
}

func mergeTags(dst []any, src any) ([]any, error) {
	list, _ := src.([]any)
	for _, t := range list {
		name := asObj(t)["name"]
		dup := false
		for _, have := range dst {
			if asObj(have)["name"] == name {
				if !reflect.DeepEqual(have, t) {
					return nil, fmt.Errorf("tag %v differs between inputs", name)
				}
				dup = true
			}
		}
		if !dup {
			dst = append(dst, t)
		}
	}
	return dst, nil
}
