package tests

import (
	"bytes"
	"debug/pe"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/client"
	"github.com/giantswarm/vm-manager/tests/cluster"
)

// vmBaseStem is the image `make os-image` builds (hack/os-image.sh).
const vmBaseStem = "vm-base_0.1.0"

// vmBaseBoot bounds one boot of vm-base under TCG: the installer's, or the
// installed system's to READY=1 (minutes on a loaded 2-core machine).
const vmBaseBoot = 12 * time.Minute

// The Ignition 3.4.0 user-data of the test VM: a file, and a unit that is
// enabled (Ignition writes a preset; the first boot applies it) and leaves
// proof that it ran.
const vmBaseIgnition = `{"ignition":{"version":"3.4.0"},
"storage":{"files":[{"path":"/etc/vmm-ignition-test","mode":420,"contents":{"source":"data:,written%20by%20ignition"}}]},
"systemd":{"units":[{"name":"vmm-hello.service","enabled":true,
"contents":"[Unit]\nDescription=written by Ignition\n[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/sh -c 'echo hello from ignition > /var/lib/vmm-hello'\n[Install]\nWantedBy=multi-user.target\n"}]}}`

// TestVMBase boots the project's real OS image, vm-base (Debian 13, systemd,
// erofs root behind dm-verity, Ignition in the initrd), with attestation
// required, through the three binaries: the installer boot, the first
// installed boot (both quotes verified against the policy the build wrote),
// Ignition applying the released user-data only after the initrd quote
// verified, provisioning from the IMDS, exec and port forwards through the
// image's OpenSSH, persistence across reboot_vm, the Kubernetes system
// extension in PCR 13, suspend and resume; and tampered copies refused. One
// boot is shared by all the checks. make test-os builds the image and runs it.
func TestVMBase(t *testing.T) {
	src := os.Getenv("VMM_OS_IMAGE_DIR")
	if src == "" {
		t.Skip("vm-base is built by make os-image; make test-os runs this test with VMM_OS_IMAGE_DIR set")
	}
	if _, err := os.Stat(filepath.Join(src, vmBaseStem+".raw")); err != nil {
		t.Fatalf("no vm-base in %s (make os-image): %v", src, err)
	}
	images := t.TempDir()
	kube := linkVMBase(t, src, images)
	tampered := tamperVMBase(t, src, images)
	// (g) Everything goes through a fleet gateway in front of the node: the
	// create is placed and routed, and so is every call after it.
	f := cluster.StartFleet(t, binDir, 1, cluster.Options{ImageDir: images, Quiet: true}, func(int) string { return "os=vm-base" })
	c := f.Nodes[0]
	a := api{t: t, base: "http://" + f.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })

	pub := testSSHKey(t)
	body, _ := json.Marshal(map[string]any{
		"name": "base1", "image": "vm-base", "hostname": "base1-host", "memory_mib": 1024, "cpus": 2,
		"kubernetes_version": kube, "user_data": vmBaseIgnition, "ssh_authorized_keys": []string{pub}, "wait_for": "none",
	})
	// (g) The watch sees the two-phase flow as it happens.
	watch := watchSSE(t, a.base+"/vms:watch?name=base1", "")
	start := time.Now()
	vm := a.vm("POST", "/vms", string(body), 201)

	// (a) The gate: attestation is held (SIGSTOP) from the installed boot's
	// start until Ignition has been answered 503, so the quote cannot have
	// verified before; then it runs on and the quote verifies.
	a.waitStateIn(vm.ID, vmBaseBoot, "booting", "attesting")
	installed := time.Since(start)
	console := filepath.Join(a.get(vm.ID).Paths.Dir, "console.log")
	pid := c.Pid("attestation")
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	held := true
	resume := func() {
		if held {
			held = false
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}
	t.Cleanup(resume)
	cluster.Eventually(t, vmBaseBoot, "Ignition answered 503 while the gate is closed", func() error {
		if b, _ := os.ReadFile(console); !bytes.Contains(b, []byte("GET result: Service Unavailable")) {
			return fmt.Errorf("not yet (%d bytes of console)", len(b))
		}
		return nil
	})
	resume()
	v := a.waitReady(vm.ID, vmBaseBoot)
	t.Logf("installed after %s, ready %s after create", installed.Round(time.Second), time.Since(start).Round(time.Second))
	att := v.Attestation
	if att.Initrd == nil || !att.Initrd.Verified || att.Ready == nil || !att.Ready.Verified || !att.UserDataReleased || fmt.Sprint(att.Boot) != "1" {
		t.Fatalf("first boot not verified at both stages: %+v / %+v (boot %v)", att.Initrd, att.Ready, att.Boot)
	}
	// Ignition was answered 503 before it got the user-data, once; and the
	// host served the user-data only after attestation's verdict (their logs,
	// one clock).
	out, _ := os.ReadFile(console)
	gatedAt, fetchedAt := bytes.Index(out, []byte("GET result: Service Unavailable")), bytes.Index(out, []byte("GET result: OK"))
	if gatedAt < 0 || fetchedAt < gatedAt || bytes.Count(out, []byte("GET result: OK")) != 1 {
		t.Errorf("console: Ignition's 503 at %d, its user-data at %d (%d times)", gatedAt, fetchedAt, bytes.Count(out, []byte("GET result: OK")))
	}
	verdict := logTime(t, filepath.Join(c.Dir, "attestation.log"), `msg="attestation verdict" .*vm=`+vm.ID+` stage=STAGE_INITRD verified=true`)
	served := logTime(t, filepath.Join(c.Dir, "hypervisor.log"), `msg="imds: user-data served" .*vm=`+vm.ID)
	if !served.After(verdict) {
		t.Errorf("user-data served at %s, the initrd quote verified at %s", served, verdict)
	}
	if r := a.sh(vm.ID, "cat /etc/vmm-ignition-test; echo; systemctl is-enabled vmm-hello.service; cat /var/lib/vmm-hello"); r.ExitCode != 0 ||
		r.Stdout != "written by ignition\nenabled\nhello from ignition\n" {
		t.Errorf("Ignition's file and unit: %+v", r)
	}

	var states []string
	events, _, werrs := watch.seen()
	for _, e := range events {
		if e.VM == vm.ID && (len(states) == 0 || states[len(states)-1] != e.State) {
			states = append(states, e.State)
		}
	}
	if !isSubsequence([]string{"installing", "booting", "attesting", "ready"}, states) || len(werrs) > 0 {
		t.Errorf("the watch saw %v (errors %v); want installing, booting, attesting, ready in that order", states, werrs)
	}

	// (b) Provisioning from the IMDS; a clean boot.
	if r := a.sh(vm.ID, "hostname; grep -c '"+strings.Fields(pub)[1]+"' /root/.ssh/authorized_keys; systemctl is-system-running --wait; systemctl --failed --no-legend --plain"); r.Stdout != "base1-host\n1\nrunning\n" {
		t.Errorf("hostname, keys, system state: %+v", r)
	}

	// Where the boot's time went, for docs/guest.md.
	if r := a.sh(vm.ID, "systemd-analyze; systemd-analyze critical-chain vm-agent.service systemd-networkd.service; systemd-analyze blame | grep -v '\\.device$' | head -20; journalctl -b -o short-monotonic --no-pager -u vm-kubernetes.service -u vm-agent.service | head -30; echo 'gaps over 1 s in the journal:'; journalctl -b -o short-monotonic --no-pager | awk -F'[][]' '{t=$2+0; if (p && t-p>1) printf \"%.1fs before %s\\n\", t-p, substr($0,1,160); p=t}' | head -40"); r.ExitCode == 0 {
		t.Logf("systemd-analyze:\n%s", r.Stdout)
	}

	// (c) Access through the image's OpenSSH.
	if r := a.sh(vm.ID, ". /etc/os-release; echo $ID $VERSION_ID $IMAGE_ID; ps -o comm= -p $PPID"); r.ExitCode != 0 || !strings.HasPrefix(r.Stdout, "debian 13 vm-base\nsshd") {
		t.Errorf("exec: %+v", r)
	}
	if banner, err := sshBanner(a.forward(vm.ID, 22)); err != nil || !strings.HasPrefix(banner, "SSH-2.0-OpenSSH_") {
		t.Errorf("forward_port 22: banner %q, %v", banner, err)
	}
	cl, err := client.Dial(f.Addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	s := openExec(t, cl, &hypervisorv1.ExecStart{Id: vm.ID, Command: []string{"/bin/bash"}, Pty: &hypervisorv1.ExecPty{Term: "xterm", Rows: 30, Cols: 90}})
	s.stdin("tty; stty size\n")
	s.waitOut("/dev/pts/")
	s.waitOut("30 90")
	s.stdin("exit 5\n")
	if exit := s.wait(); exit.GetExitCode() != 5 {
		t.Errorf("streamed exec on a pty: exit %v", exit)
	}

	// (e) The Kubernetes extension: merged, its binaries there, PCR 13 the
	// policy's value for the version.
	var policy struct {
		PCR13 map[string]string `json:"pcr13"`
	}
	if err := json.Unmarshal(readFile(t, filepath.Join(src, vmBaseStem+".policy.json")), &policy); err != nil {
		t.Fatal(err)
	}
	if got, want := v.Attestation.Ready.Pcrs["13"], policy.PCR13[kube]; want == "" || got != want ||
		!strings.Contains(v.Attestation.Ready.Message, "pcr 13 kubernetes "+kube) {
		t.Errorf("PCR 13 %s, policy %q; ready verdict %q", got, want, v.Attestation.Ready.Message)
	}
	if r := a.sh(vm.ID, "systemd-sysext list --no-legend | grep -c kubernetes_"+kube+"; timeout 60 sh -c 'until systemctl -q is-active containerd.service; do sleep 1; done'; systemctl is-active containerd.service; containerd --version; runc --version | head -1"); r.ExitCode != 0 ||
		!strings.HasPrefix(r.Stdout, "1\nactive\ncontainerd ") || !strings.Contains(r.Stdout, "runc version") {
		t.Errorf("sysext and its binaries: %+v", r)
	}

	// (d) reboot_vm: /etc, the machine id and the host keys stay; Ignition
	// does not run again; both quotes verify again.
	before := a.sh(vm.ID, "echo kept > /etc/vmm-persist; cat /etc/machine-id; ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub")
	fetches := bytes.Count(readFile(t, console), []byte("GET result: OK"))
	a.vm("POST", "/vms/"+vm.ID+"/reboot", "", 200)
	v = a.waitReady(vm.ID, vmBaseBoot)
	if fmt.Sprint(v.Attestation.Boot) != "2" || v.Attestation.Initrd == nil || !v.Attestation.Initrd.Verified || !v.Attestation.Ready.Verified {
		t.Errorf("second boot: %+v", v.Attestation)
	}
	after := a.sh(vm.ID, "cat /etc/vmm-persist; cat /etc/machine-id; ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub")
	if after.Stdout != "kept\n"+before.Stdout {
		t.Errorf("after reboot %q, before %q", after.Stdout, before.Stdout)
	}
	if n := bytes.Count(readFile(t, console), []byte("GET result: OK")); n != fetches {
		t.Errorf("Ignition fetched %d times after reboot_vm", n-fetches)
	}

	// (g) Suspend and resume: the same boot goes on.
	a.vm("POST", "/vms/"+vm.ID+"/suspend", "", 200)
	a.waitState(vm.ID, "suspended", vmBaseBoot)
	a.vm("POST", "/vms/"+vm.ID+"/resume", "", 200)
	a.waitState(vm.ID, "ready", vmBaseBoot)
	if r := a.sh(vm.ID, "cat /etc/vmm-persist"); r.Stdout != "kept\n" {
		t.Errorf("after resume: %+v", r)
	}

	// (f) Tampered copies, booted one after the other under the genuine policy,
	// each created on the node by name (placement would find no free cpus
	// beside base1 on two cores).
	for _, tc := range tampered {
		id := a.vm("POST", "/vms", fmt.Sprintf(`{"name":%q,"image":%q,"memory_mib":1024,"cpus":2,"wait_for":"none","node":%q}`, tc.image, tc.image, f.Names[0]), 201).ID
		var got ukiVM
		cluster.Eventually(t, 2*vmBaseBoot, tc.image+" refused", func() error {
			got = a.uki(id)
			if tc.stage == "" && (got.State == "stopped" || got.State == "failed") {
				return nil
			}
			if tc.stage == "initrd" && got.Attestation.Initrd != nil {
				return nil
			}
			return fmt.Errorf("state %s", got.State)
		})
		switch {
		case tc.stage == "" && !strings.Contains(got.LastError, tc.want):
			t.Errorf("%s: lastError %q, want it to name %q", tc.image, got.LastError, tc.want)
		case tc.stage == "initrd" && (got.Attestation.Initrd.Verified || !strings.Contains(got.Attestation.Initrd.Message, tc.want) || got.Attestation.UserDataReleased):
			t.Errorf("%s: initrd verdict %+v, want a rejection naming %q", tc.image, got.Attestation.Initrd, tc.want)
		}
		t.Logf("%s: %s %s", tc.image, got.State, firstLine(got.LastError))
		a.vm("DELETE", "/vms/"+id, "", 204)
	}

	// (g) A lifetime ends it as it ends a test guest: ACPI, and the real
	// OS powers off.
	a.lifetimeVM("POST", "/vms/"+vm.ID+"/lifetime", `{"ttl":"10s"}`, 200)
	stopped, _ := a.waitStopped(vm.ID, vmBaseBoot)
	if !strings.Contains(stopped.LastError, "lifetime expired") || stopped.Lifetime != nil {
		t.Errorf("after its ttl: state %s, lastError %q, lifetime %+v", stopped.State, stopped.LastError, stopped.Lifetime)
	}
}

// isSubsequence says whether want appears in got in order (other elements
// may come between).
func isSubsequence(want, got []string) bool {
	i := 0
	for _, g := range got {
		if i < len(want) && g == want[i] {
			i++
		}
	}
	return i == len(want)
}

func (a api) waitStateIn(id string, d time.Duration, states ...string) {
	a.t.Helper()
	cluster.Eventually(a.t, d, "vm "+id+" "+strings.Join(states, " or "), func() error {
		v := a.uki(id)
		for _, s := range states {
			if v.State == s {
				return nil
			}
		}
		if v.State == "failed" || v.State == "stopped" {
			a.t.Fatalf("vm %s %s: %s", id, v.State, v.LastError)
		}
		return fmt.Errorf("state %s", v.State)
	})
}

func (a api) waitReady(id string, d time.Duration) ukiVM {
	a.t.Helper()
	a.waitStateIn(id, d, "ready")
	return a.uki(id)
}

// logTime is the time of the first line of a service's log matching re.
func logTime(t *testing.T, path, re string) time.Time {
	t.Helper()
	m := regexp.MustCompile(`(?m)^time=(\S+) .*` + re).FindSubmatch(readFile(t, path))
	if m == nil {
		t.Fatalf("no line matching %q in %s", re, path)
	}
	at, err := time.Parse(time.RFC3339Nano, string(m[1]))
	if err != nil {
		t.Fatal(err)
	}
	return at
}

func firstLine(s string) string { l, _, _ := strings.Cut(s, "\n"); return l }

// linkVMBase puts vm-base and its own sysext tree (<stem>.sysupdate/) into
// dir, hard-linked (the IMDS follows no link out of the tree); it returns
// the Kubernetes version the tree offers.
func linkVMBase(t testing.TB, src, dir string) string {
	t.Helper()
	for _, ext := range []string{".efi", ".raw", ".policy.json"} {
		linkOrCopy(t, filepath.Join(src, vmBaseStem+ext), filepath.Join(dir, vmBaseStem+ext))
	}
	tree := vmBaseStem + ".sysupdate/kubernetes"
	if err := os.MkdirAll(filepath.Join(dir, tree), 0o755); err != nil {
		t.Fatal(err)
	}
	linkOrCopy(t, filepath.Join(src, tree, "SHA256SUMS"), filepath.Join(dir, tree, "SHA256SUMS"))
	sums, err := os.ReadFile(filepath.Join(src, tree, "SHA256SUMS"))
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`  kubernetes_(\S+)\.raw`).FindSubmatch(sums)
	if m == nil {
		t.Fatalf("SHA256SUMS lists no Kubernetes extension:\n%s", sums)
	}
	name := "kubernetes_" + string(m[1]) + ".raw"
	linkOrCopy(t, filepath.Join(src, tree, name), filepath.Join(dir, tree, name))
	return string(m[1])
}

func linkOrCopy(t testing.TB, from, to string) {
	t.Helper()
	if os.Link(from, to) == nil {
		return
	}
	if out, err := exec.Command("cp", "--sparse=always", from, to).CombinedOutput(); err != nil {
		t.Fatalf("cp %s: %v %s", from, err, out)
	}
}

type tamperedBase struct {
	image string
	stage string // "": the boot stops before any quote; "initrd": the initrd quote is refused
	want  string
}

// tamperVMBase writes three copies of vm-base under the genuine policy: one
// byte of the root partition changed (dm-verity), and a UKI whose command
// line or initrd differs, on the disk's ESP and as the installer's UKI.
func tamperVMBase(t *testing.T, src, dir string) []tamperedBase {
	t.Helper()
	var policy map[string]any
	if err := json.Unmarshal(readFile(t, filepath.Join(src, vmBaseStem+".policy.json")), &policy); err != nil {
		t.Fatal(err)
	}
	withPolicy := func(image string) string {
		stem := image + "_0.1.0"
		policy["image_id"] = image
		b, _ := json.Marshal(policy)
		writeFile(t, filepath.Join(dir, stem+".policy.json"), b)
		return stem
	}
	disk := func(stem string) string {
		p := filepath.Join(dir, stem+".raw")
		if out, err := exec.Command("cp", "--sparse=always", filepath.Join(src, vmBaseStem+".raw"), p).CombinedOutput(); err != nil {
			t.Fatalf("cp: %v %s", err, out)
		}
		return p
	}
	parts := partitions(t, filepath.Join(src, vmBaseStem+".raw"))

	// dm-verity: one byte in the middle of the root's first 4 KiB block
	// after the erofs superblock's block: read by every mount.
	stem := withPolicy("verity-base")
	linkOrCopy(t, filepath.Join(src, vmBaseStem+".efi"), filepath.Join(dir, stem+".efi"))
	f, err := os.OpenFile(disk(stem), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	off := parts["root"].start + 1024 + 8 // the erofs superblock (magic at 1024), past the magic
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0xff
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
	f.Close()
	out := []tamperedBase{{image: "verity-base", want: "verity"}}

	// UKIs with another command line or initrd (replaceSection), also
	// written over the UKI on the disk's ESP.
	sec := t.TempDir()
	uki, err := pe.Open(filepath.Join(src, vmBaseStem+".efi"))
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{".cmdline", ".initrd"} {
		s := uki.Section(name)
		b, err := io.ReadAll(io.LimitReader(s.Open(), int64(s.VirtualSize)))
		if err != nil {
			t.Fatal(err)
		}
		writeFile(t, filepath.Join(sec, name[1:]), b)
	}
	uki.Close()
	writeFile(t, filepath.Join(sec, "cmdline.tampered"), append(readFile(t, filepath.Join(sec, "cmdline")), " tampered=1"...))
	writeFile(t, filepath.Join(sec, "initrd.tampered"), append(readFile(t, filepath.Join(sec, "initrd")), newc("etc/tampered", "a file the policy does not vouch for\n")...))
	for _, tc := range []struct{ image, section string }{{"cmdline-base", "cmdline"}, {"initrd-base", "initrd"}} {
		stem := withPolicy(tc.image)
		efi := filepath.Join(dir, stem+".efi")
		replaceSection(t, filepath.Join(src, vmBaseStem+".efi"), efi, "."+tc.section, filepath.Join(sec, tc.section+".tampered"))
		raw := disk(stem)
		cmd := exec.Command("mcopy", "-o", "-i", fmt.Sprintf("%s@@%d", raw, parts["esp"].start), efi, "::/EFI/Linux/"+vmBaseStem+".efi")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("mcopy: %v %s", err, out)
		}
		out = append(out, tamperedBase{image: tc.image, stage: "initrd", want: "." + tc.section})
	}
	return out
}

// replaceSection writes a copy of a UKI whose section name holds file:
// removed, then added again after the last section (objcopy's
// --update-section keeps the old virtual size, so systemd-stub would
// measure and use the old bytes). The stub finds sections by name.
func replaceSection(t *testing.T, in, out, name, file string) {
	t.Helper()
	f, err := pe.Open(in)
	if err != nil {
		t.Fatal(err)
	}
	var base, next uint64
	if oh, ok := f.OptionalHeader.(*pe.OptionalHeader64); ok {
		base = oh.ImageBase
	}
	for _, s := range f.Sections {
		next = max(next, uint64(s.VirtualAddress)+uint64(max(s.VirtualSize, s.Size)))
	}
	f.Close()
	next = (next + 0xfff) &^ 0xfff
	cmd := exec.Command("objcopy", "--remove-section", name, "--add-section", name+"="+file,
		"--change-section-vma", fmt.Sprintf("%s=%#x", name, base+next), in, out)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("objcopy: %v %s", err, b)
	}
}

type partition struct{ start, size int64 }

// partitions are a disk's GPT partitions by name (sfdisk --json).
func partitions(t *testing.T, disk string) map[string]partition {
	t.Helper()
	b, err := exec.Command("sfdisk", "--json", disk).Output()
	if err != nil {
		t.Fatalf("sfdisk %s: %v", disk, err)
	}
	var pt struct {
		PartitionTable struct {
			SectorSize int64 `json:"sectorsize"`
			Partitions []struct {
				Start, Size int64
				Name        string
			}
		}
	}
	if err := json.Unmarshal(b, &pt); err != nil {
		t.Fatal(err)
	}
	ss := pt.PartitionTable.SectorSize
	if ss == 0 {
		ss = 512
	}
	out := map[string]partition{}
	for _, p := range pt.PartitionTable.Partitions {
		out[p.Name] = partition{start: p.Start * ss, size: p.Size * ss}
	}
	for _, name := range []string{"esp", "root", "var"} {
		if _, ok := out[name]; !ok {
			t.Fatalf("%s has no partition named %s: %s", disk, name, b)
		}
	}
	return out
}

// testSSHKey is a fresh ed25519 public key in authorized_keys form.
func testSSHKey(t *testing.T) string {
	t.Helper()
	key := filepath.Join(t.TempDir(), "id")
	if out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "vm-base-test", "-f", key).CombinedOutput(); err != nil {
		t.Fatalf("ssh-keygen: %v %s", err, out)
	}
	return strings.TrimSpace(string(readFile(t, key+".pub")))
}
