package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// stage is what the test reads of a Dockerfile stage.
type stage struct {
	from       string
	env        []string
	user       string
	entrypoint []string
	expose     []string
}

// parseDockerfile is just enough of a parser for deploy/docker/Dockerfile:
// continuation lines, FROM … AS name, ENV k=v …, USER, ENTRYPOINT [json], EXPOSE.
func parseDockerfile(t *testing.T, path string) map[string]*stage {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	text := regexp.MustCompile(`\\\n\s*`).ReplaceAllString(string(b), " ")
	stages := map[string]*stage{}
	var cur *stage
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		instr, rest, _ := strings.Cut(line, " ")
		switch strings.ToUpper(instr) {
		case "FROM":
			f := strings.Fields(rest)
			cur = &stage{from: f[0]}
			if len(f) == 3 && strings.EqualFold(f[1], "AS") {
				stages[f[2]] = cur
			}
		case "ENV":
			cur.env = append(cur.env, strings.Fields(rest)...)
		case "USER":
			cur.user = rest
		case "ENTRYPOINT":
			if err := json.Unmarshal([]byte(rest), &cur.entrypoint); err != nil {
				t.Fatalf("ENTRYPOINT %s: %v", rest, err)
			}
		case "EXPOSE":
			for _, p := range strings.Fields(rest) {
				if !strings.Contains(p, "/") {
					p += "/tcp"
				}
				cur.expose = append(cur.expose, p)
			}
		}
	}
	return stages
}

// The Dockerfile's attestation and gateway targets run like the images
// mkimage builds.
func TestDockerfileMatches(t *testing.T) {
	stages := parseDockerfile(t, filepath.Join("..", "docker", "Dockerfile"))
	for _, name := range []string{"build", "binaries", "hypervisor", "attestation", "gateway"} {
		if stages[name] == nil {
			t.Errorf("Dockerfile has no stage %q", name)
		}
	}
	if h := stages["hypervisor"]; h != nil {
		if !strings.HasPrefix(h.from, "debian:") || h.user != "0:0" || !reflect.DeepEqual(h.entrypoint, []string{"/usr/local/bin/vmm-hypervisor"}) {
			t.Errorf("hypervisor stage: %+v", h)
		}
	}
	for _, name := range []string{"attestation", "gateway"} {
		st := stages[name]
		if st == nil {
			continue
		}
		bin := filepath.Join(t.TempDir(), "bin")
		if err := os.WriteFile(bin, nil, 0o755); err != nil {
			t.Fatal(err)
		}
		img, err := Build(Config{Name: name, Binary: bin, Arch: "amd64", Epoch: time.Unix(0, 0)})
		if err != nil {
			t.Fatal(err)
		}
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(st.entrypoint, cf.Config.Entrypoint) || st.user != cf.Config.User {
			t.Errorf("%s: Dockerfile ENTRYPOINT %q USER %q, mkimage %q %q", name, st.entrypoint, st.user, cf.Config.Entrypoint, cf.Config.User)
		}
		var env []string // distroless sets PATH and HOME itself
		for _, e := range cf.Config.Env {
			if !strings.HasPrefix(e, "PATH=") && !strings.HasPrefix(e, "HOME=") {
				env = append(env, e)
			}
		}
		slices.Sort(env)
		got := slices.Sorted(slices.Values(st.env))
		if !reflect.DeepEqual(got, env) {
			t.Errorf("%s: Dockerfile ENV %q, mkimage %q", name, got, env)
		}
		var ports []string
		for p := range cf.Config.ExposedPorts {
			ports = append(ports, p)
		}
		if !reflect.DeepEqual(st.expose, ports) {
			t.Errorf("%s: Dockerfile EXPOSE %q, mkimage %q", name, st.expose, ports)
		}
	}
}
