package tests

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/tests/cluster"
)

// systemdDir holds the host install's units (docs/deploy.md).
const systemdDir = "../deploy/systemd"

// systemdServices are the three units' process names: vm-manager-<name>.service
// runs /usr/local/bin/vmm-<name>.
var systemdServices = []string{"attestation", "hypervisor", "gateway"}

// unitFile is a parsed unit: section → key → values in file order (a key
// may be given more than once; an empty assignment is kept as "").
type unitFile map[string]map[string][]string

func (u unitFile) values(section, key string) []string { return u[section][key] }

// value is the last assignment of key, as systemd reads a single-valued key.
func (u unitFile) value(section, key string) (string, bool) {
	v := u[section][key]
	if len(v) == 0 {
		return "", false
	}
	return v[len(v)-1], true
}

// words are a list-valued key's words over all its assignments (an empty
// assignment resets the list, as in systemd).
func (u unitFile) words(section, key string) []string {
	var out []string
	for _, v := range u[section][key] {
		if v == "" {
			out = nil
			continue
		}
		out = append(out, strings.Fields(v)...)
	}
	return out
}

func parseUnit(t *testing.T, path string) unitFile {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	u := unitFile{}
	section := ""
	sc := bufio.NewScanner(f)
	lineNo := 0
	var cont string
	for sc.Scan() {
		lineNo++
		line := strings.TrimSpace(sc.Text())
		if cont != "" {
			line = cont + " " + line
			cont = ""
		}
		if line == "" || line[0] == '#' || line[0] == ';' {
			continue
		}
		if strings.HasSuffix(line, `\`) {
			cont = strings.TrimSuffix(line, `\`)
			continue
		}
		if line[0] == '[' && line[len(line)-1] == ']' {
			section = line[1 : len(line)-1]
			if u[section] == nil {
				u[section] = map[string][]string{}
			}
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok || section == "" {
			t.Fatalf("%s:%d: not a key=value line in a section: %q", path, lineNo, line)
		}
		k = strings.TrimSpace(k)
		u[section][k] = append(u[section][k], strings.TrimSpace(v))
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return u
}

// TestSystemdUnitsVerify checks deploy/systemd: systemd-analyze verify on the
// units with the ExecStart binaries pointed at the ones this test run built
// (any line it prints about them fails the test, warnings included), the
// properties the host install depends on, the units' flags and the env
// example's variables against the binaries' own flags, the exposure score of
// systemd-analyze security, and the sysusers file. Nothing is started.
func TestSystemdUnitsVerify(t *testing.T) {
	analyze := cluster.RequireTool(t, "systemd-analyze")

	unitNames := []string{"vm-manager.target"}
	for _, s := range systemdServices {
		unitNames = append(unitNames, "vm-manager-"+s+".service")
	}
	units := map[string]unitFile{}
	for _, n := range unitNames {
		units[n] = parseUnit(t, filepath.Join(systemdDir, n))
	}
	help := map[string]string{}
	for _, s := range systemdServices {
		out, err := exec.Command(filepath.Join(binDir, "vmm-"+s), "serve", "--help").CombinedOutput()
		if err != nil {
			t.Fatalf("vmm-%s serve --help: %v\n%s", s, err, out)
		}
		help[s] = string(out)
	}

	t.Run("verify", func(t *testing.T) {
		dir := t.TempDir()
		var paths []string
		for _, n := range unitNames {
			b, err := os.ReadFile(filepath.Join(systemdDir, n))
			if err != nil {
				t.Fatal(err)
			}
			// verify checks that ExecStart's binary exists and is executable.
			s := strings.ReplaceAll(string(b), "/usr/local/bin/vmm-", filepath.Join(binDir, "vmm-"))
			p := filepath.Join(dir, n)
			if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
				t.Fatal(err)
			}
			paths = append(paths, p)
		}
		args := []string{"verify", "--man=no"}
		if usage, _ := exec.Command(analyze, "--help").CombinedOutput(); strings.Contains(string(usage), "--recursive-errors") {
			// Only our units decide the exit status; the host's units are
			// still loaded (multi-user.target, network-online.target).
			args = append(args, "--recursive-errors=no")
		}
		cmd := exec.Command(analyze, append(args, paths...)...)
		// info surfaces every warning and notice, without the debug chatter.
		cmd.Env = append(os.Environ(), "SYSTEMD_LOG_LEVEL=info", "SYSTEMD_LOG_COLOR=0", "SYSTEMD_PAGER=")
		out, err := cmd.CombinedOutput()
		t.Logf("%s %s: %v\n%s", analyze, strings.Join(cmd.Args[1:], " "), err, out)
		if err != nil {
			t.Errorf("systemd-analyze verify failed: %v", err)
		}
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			if line == "" {
				continue
			}
			ours := strings.Contains(line, dir)
			for _, n := range unitNames {
				ours = ours || strings.Contains(line, n)
			}
			if ours {
				t.Errorf("systemd-analyze verify: %s", line)
			}
		}
	})

	t.Run("target", func(t *testing.T) {
		u := units["vm-manager.target"]
		wants := u.words("Unit", "Wants")
		for _, s := range systemdServices {
			if !slices.Contains(wants, "vm-manager-"+s+".service") {
				t.Errorf("vm-manager.target: Wants= %v lacks vm-manager-%s.service", wants, s)
			}
		}
		if w := u.words("Install", "WantedBy"); !slices.Contains(w, "multi-user.target") {
			t.Errorf("vm-manager.target: WantedBy= %v, want multi-user.target", w)
		}
	})

	for _, s := range systemdServices {
		name := "vm-manager-" + s + ".service"
		t.Run(s, func(t *testing.T) {
			u := units[name]
			expect := func(section, key, want string) {
				t.Helper()
				if got, ok := u.value(section, key); !ok || got != want {
					t.Errorf("%s: %s=%q (set: %v), want %q", name, key, got, ok, want)
				}
			}
			expect("Unit", "PartOf", "vm-manager.target")
			if w := u.words("Install", "WantedBy"); !slices.Contains(w, "vm-manager.target") {
				t.Errorf("%s: WantedBy= %v, want vm-manager.target", name, w)
			}
			// Restarting one service must not restart another.
			for _, k := range []string{"Requires", "BindsTo", "Requisite", "PartOf"} {
				for _, w := range u.words("Unit", k) {
					if strings.HasPrefix(w, "vm-manager-") {
						t.Errorf("%s: %s=%s ties it to another service", name, k, w)
					}
				}
			}
			expect("Service", "User", "vm-manager")
			expect("Service", "Group", "vm-manager")
			envFiles := u.values("Service", "EnvironmentFile")
			if want := []string{"-/etc/vm-manager/env", "-/etc/vm-manager/" + s + ".env"}; !slices.Equal(envFiles, want) {
				t.Errorf("%s: EnvironmentFile= %q, want %q (shared first, optional)", name, envFiles, want)
			}
			expect("Service", "Restart", "on-failure")
			expect("Service", "RestartSec", "5s")
			expect("Service", "TimeoutStopSec", "90s")
			expect("Service", "UMask", "0027")
			expect("Service", "RuntimeDirectory", "vm-manager")
			expect("Service", "RuntimeDirectoryPreserve", "yes")
			expect("Service", "NoNewPrivileges", "yes")
			expect("Service", "CapabilityBoundingSet", "")
			expect("Service", "ProtectSystem", "strict")
			expect("Service", "ProtectHome", "yes")
			expect("Service", "PrivateTmp", "yes")
			expect("Service", "ProtectKernelTunables", "yes")
			expect("Service", "ProtectKernelModules", "yes")
			expect("Service", "ProtectKernelLogs", "yes")
			expect("Service", "ProtectControlGroups", "yes")
			expect("Service", "RestrictNamespaces", "yes")
			expect("Service", "LockPersonality", "yes")
			expect("Service", "SystemCallArchitectures", "native")

			exe, _ := u.value("Service", "ExecStart")
			argv := strings.Fields(exe)
			if len(argv) < 2 || argv[0] != "/usr/local/bin/vmm-"+s || argv[1] != "serve" {
				t.Fatalf("%s: ExecStart=%s, want /usr/local/bin/vmm-%s serve …", name, exe, s)
			}
			if !slices.Contains(argv, "--run-dir=/run/vm-manager") {
				t.Errorf("%s: ExecStart lacks --run-dir=/run/vm-manager: %s", name, exe)
			}
			// Every flag the unit passes is one the binary has.
			for _, a := range argv[2:] {
				flag, _, _ := strings.Cut(a, "=")
				if !strings.HasPrefix(flag, "--") || !regexp.MustCompile(`(?m)^\s+`+regexp.QuoteMeta(flag)+`\s`).MatchString(help[s]) {
					t.Errorf("%s: ExecStart passes %s, which vmm-%s serve does not have:\n%s", name, a, s, help[s])
				}
			}

			families := u.words("Service", "RestrictAddressFamilies")
			switch s {
			case "hypervisor":
				expect("Service", "KillMode", "process")
				expect("Service", "SupplementaryGroups", "kvm")
				expect("Service", "DevicePolicy", "closed")
				if d := u.words("Service", "StateDirectory"); !slices.Contains(d, "vm-manager") || !slices.Contains(d, "vm-manager/images") {
					t.Errorf("%s: StateDirectory= %v, want vm-manager and vm-manager/images", name, d)
				}
				expect("Service", "LimitNOFILE", "65536")
				allow := u.values("Service", "DeviceAllow")
				for _, d := range []string{"/dev/kvm rw", "/dev/vhost-vsock rw", "/dev/net/tun rw"} {
					if !slices.Contains(allow, d) {
						t.Errorf("%s: DeviceAllow= %q lacks %q", name, allow, d)
					}
				}
				// QEMU inherits the sandbox: TCG's JIT needs W+X memory and
				// PrivateDevices would hide /dev/kvm.
				if v, ok := u.value("Service", "MemoryDenyWriteExecute"); ok && v != "no" {
					t.Errorf("%s: MemoryDenyWriteExecute=%s breaks QEMU's TCG", name, v)
				}
				if v, ok := u.value("Service", "PrivateDevices"); ok && v != "no" {
					t.Errorf("%s: PrivateDevices=%s hides /dev/kvm", name, v)
				}
				for _, f := range []string{"AF_UNIX", "AF_INET", "AF_INET6", "AF_VSOCK", "AF_NETLINK"} {
					if !slices.Contains(families, f) {
						t.Errorf("%s: RestrictAddressFamilies= %v lacks %s", name, families, f)
					}
				}
				for _, a := range []string{"--state-dir=/var/lib/vm-manager", "--image-dir=/var/lib/vm-manager/images"} {
					if !slices.Contains(argv, a) {
						t.Errorf("%s: ExecStart lacks %s: %s", name, a, exe)
					}
				}
				if after := u.words("Unit", "After"); !slices.Contains(after, "vm-manager-attestation.service") {
					t.Errorf("%s: After= %v lacks vm-manager-attestation.service", name, after)
				}
			default:
				expect("Service", "MemoryDenyWriteExecute", "yes")
				expect("Service", "PrivateDevices", "yes")
				if d := u.values("Service", "DeviceAllow"); len(d) > 0 {
					t.Errorf("%s: DeviceAllow= %q, want none", name, d)
				}
				if _, ok := u.value("Service", "KillMode"); ok {
					t.Errorf("%s: KillMode set; only the hypervisor leaves processes behind", name)
				}
				for _, f := range families {
					if f != "AF_UNIX" && f != "AF_INET" && f != "AF_INET6" {
						t.Errorf("%s: RestrictAddressFamilies= %v allows %s", name, families, f)
					}
				}
				if !slices.Contains(families, "AF_UNIX") {
					t.Errorf("%s: RestrictAddressFamilies= %v lacks AF_UNIX", name, families)
				}
			}
			switch s {
			case "attestation":
				expect("Service", "StateDirectory", "vm-manager")
				if !slices.Contains(argv, "--state-dir=/var/lib/vm-manager") {
					t.Errorf("%s: ExecStart lacks --state-dir=/var/lib/vm-manager: %s", name, exe)
				}
			case "gateway":
				if _, ok := u.value("Service", "StateDirectory"); ok {
					t.Errorf("%s: the gateway has no state", name)
				}
				// Nor a path to the VerifierService's socket in the state directory.
				if p := u.words("Service", "InaccessiblePaths"); !slices.Contains(p, "-/var/lib/vm-manager") {
					t.Errorf("%s: InaccessiblePaths= %v lacks -/var/lib/vm-manager", name, p)
				}
				if env := u.values("Service", "Environment"); !slices.Contains(env, "VM_MANAGER_LISTEN=127.0.0.1:8080") {
					t.Errorf("%s: Environment= %q lacks VM_MANAGER_LISTEN=127.0.0.1:8080", name, env)
				}
				// A --listen flag would beat the environment files.
				for _, a := range argv {
					if strings.HasPrefix(a, "--listen") {
						t.Errorf("%s: ExecStart passes %s; /etc/vm-manager/gateway.env could not change it", name, a)
					}
				}
				after := u.words("Unit", "After")
				for _, d := range []string{"vm-manager-attestation.service", "vm-manager-hypervisor.service"} {
					if !slices.Contains(after, d) {
						t.Errorf("%s: After= %v lacks %s", name, after, d)
					}
				}
			}
		})
	}

	t.Run("env.example", func(t *testing.T) {
		b, err := os.ReadFile(filepath.Join(systemdDir, "env.example"))
		if err != nil {
			t.Fatal(err)
		}
		assign := regexp.MustCompile(`^#?([A-Z][A-Z0-9_]*)=(.*)$`)
		seen := 0
		for i, line := range strings.Split(string(b), "\n") {
			m := assign.FindStringSubmatch(line)
			if m == nil {
				if line != "" && !strings.HasPrefix(line, "#") {
					t.Errorf("env.example:%d: neither a comment nor VAR=value: %q", i+1, line)
				}
				continue
			}
			// systemd keeps a trailing "# …" as part of the value.
			if strings.Contains(m[2], "#") {
				t.Errorf("env.example:%d: %s's value holds a comment: %q", i+1, m[1], line)
			}
			if !strings.HasPrefix(m[1], "VM_MANAGER_") {
				continue
			}
			seen++
			known := false
			for _, h := range help {
				known = known || strings.Contains(h, "$"+m[1]+" ")
			}
			if !known {
				t.Errorf("env.example:%d: no binary reads %s", i+1, m[1])
			}
		}
		if seen == 0 {
			t.Error("env.example names no VM_MANAGER_ variable")
		}
	})

	t.Run("security", func(t *testing.T) {
		if usage, _ := exec.Command(analyze, "--help").CombinedOutput(); !strings.Contains(string(usage), "--offline") {
			t.Skip("systemd-analyze has no security --offline (systemd < 250)")
		}
		// Exposure on systemd's 0–100 scale (it prints 0.0–10.0): the
		// hypervisor keeps devices, W+X memory and AF_VSOCK for QEMU.
		limits := map[string]int{"attestation": 20, "hypervisor": 30, "gateway": 20}
		for _, s := range systemdServices {
			p, _ := filepath.Abs(filepath.Join(systemdDir, "vm-manager-"+s+".service"))
			cmd := exec.Command(analyze, "security", "--offline=yes", "--no-pager", fmt.Sprintf("--threshold=%d", limits[s]), p)
			cmd.Env = append(os.Environ(), "SYSTEMD_LOG_COLOR=0", "SYSTEMD_COLORS=0")
			out, err := cmd.CombinedOutput()
			lines := strings.Split(strings.TrimSpace(string(out)), "\n")
			t.Logf("%s", lines[len(lines)-1])
			if err != nil {
				t.Errorf("vm-manager-%s.service: exposure over %d.%d: %v\n%s", s, limits[s]/10, limits[s]%10, err, out)
			}
		}
	})

	t.Run("sysusers", func(t *testing.T) {
		sysusers, err := exec.LookPath("systemd-sysusers")
		if err != nil {
			t.Skipf("systemd-sysusers not installed: %v", err)
		}
		f, err := os.Open(filepath.Join(systemdDir, "vm-manager.sysusers"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		root := t.TempDir()
		if err := os.MkdirAll(filepath.Join(root, "etc"), 0o755); err != nil {
			t.Fatal(err)
		}
		cmd := exec.Command(sysusers, "--dry-run", "--root="+root, "-")
		cmd.Stdin = f
		cmd.Env = append(os.Environ(), "SYSTEMD_LOG_LEVEL=info", "SYSTEMD_LOG_COLOR=0")
		out, err := cmd.CombinedOutput()
		t.Logf("systemd-sysusers --dry-run: %v\n%s", err, out)
		if err != nil || strings.Contains(string(out), "ignoring") || !strings.Contains(string(out), "vm-manager") {
			t.Errorf("vm-manager.sysusers: %v\n%s", err, out)
		}
	})
}
