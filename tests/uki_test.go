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
	"sync"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/tests/cluster"
)

const ukiStem = "test-guest-uki_0.1.0"

// ukiVM is the part of a UKI VM's record the test reads.
type ukiVM struct {
	ID                string `json:"id"`
	Name              string `json:"name"`
	State             string `json:"state"`
	LastError         string `json:"lastError"`
	KubernetesVersion string `json:"kubernetesVersion"`
	InstalledAt       string `json:"installedAt"`
	BootedAt          string `json:"bootedAt"`
	ReadyAt           string `json:"readyAt"`
	Attestation       struct {
		UserDataReleased bool   `json:"userDataReleased"`
		Boot             any    `json:"boot"`
		Initrd           *quote `json:"initrd"`
		Ready            *quote `json:"ready"`
	} `json:"attestation"`
}

type quote struct {
	Verified         bool              `json:"verified"`
	Message          string            `json:"message"`
	Learned          []int             `json:"learned"`
	LearnMode        bool              `json:"learnMode"`
	Pcrs             map[string]string `json:"pcrs"`
	MismatchedEvents []struct {
		Pcr            int    `json:"pcr"`
		Type           string `json:"type"`
		Description    string `json:"description"`
		Digest         string `json:"digest"`
		ExpectedDigest string `json:"expectedDigest"`
	} `json:"mismatchedEvents"`
}

func (a api) uki(id string) ukiVM {
	a.t.Helper()
	code, _, b := cluster.Do(a.t, "GET", a.base+"/vms/"+id, "")
	var v ukiVM
	if code != 200 || json.Unmarshal(b, &v) != nil {
		a.t.Fatalf("get %s: %d %s", id, code, b)
	}
	return v
}

// TestUKIImage boots the UKI test guest the way the original's images boot
// (contract §3.2, §8): the installer boot writes the image's disk onto the
// VM's volume and powers off, the installed boot comes up from that volume
// through systemd-stub, measures its boot phases into PCR 11 and the
// Kubernetes system extension into PCR 13, and attests at both stages
// against the policy the image was built with: no learn mode, no golden
// values recorded at run time. Then four tampered boots of the same
// policy, each rejected, naming the PCR and the event.
func TestUKIImage(t *testing.T) {
	src := cluster.GuestImages(t, "..")
	if _, err := os.Stat(filepath.Join(src, ukiStem+".efi")); err != nil {
		t.Fatalf("no UKI test guest in %s (make guest-image builds it): %v", src, err)
	}
	images := t.TempDir()
	tamper := newTamperKit(t, src, images)
	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: images, Quiet: true})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })

	// A Kubernetes version the image does not offer changes nothing.
	expectError(t, "POST", a.base+"/vms", `{"name":"nok8s","image":"test-guest-uki","kubernetes_version":"1.20.0"}`, 400, apierr.InvalidRequest)

	// The tampered boots run beside the good one.
	type tampered struct{ name, image, kubernetes string }
	cases := []tampered{
		{"t-cmdline", "cmdline-uki", ""},
		{"t-initrd", "initrd-uki", ""},
		{"t-disk", "disk-uki", ""},
		{"t-sysext", "test-guest-uki", tamper.badKubernetes},
	}
	ids := map[string]string{}
	for _, tc := range cases {
		body := fmt.Sprintf(`{"name":%q,"image":%q,"memory_mib":384,"cpus":1,"wait_for":"none","user_data":"secret of %s"`, tc.name, tc.image, tc.name)
		if tc.kubernetes != "" {
			body += fmt.Sprintf(`,"kubernetes_version":%q`, tc.kubernetes)
		}
		ids[tc.name] = a.vm("POST", "/vms", body+"}", 201).ID
	}

	// The good one: wait_for installed returns once the installer is done.
	start := time.Now()
	secret := `{"ignition":{"version":"3.4.0"},"storage":{"files":[{"path":"/etc/uki-secret","contents":{"source":"data:,released%20after%20attestation"}}]}}`
	body, _ := json.Marshal(map[string]any{"name": "uki", "image": "test-guest-uki", "memory_mib": 384, "cpus": 1, "wait_for": "installed", "user_data": secret})
	code, _, b := cluster.Do(t, "POST", a.base+"/vms", string(body))
	var vm ukiVM
	if code != 201 || json.Unmarshal(b, &vm) != nil {
		t.Fatalf("create: %d %s", code, b)
	}
	t.Logf("wait_for installed returned after %s: state %s, installed %s", time.Since(start).Round(time.Millisecond), vm.State, vm.InstalledAt)
	// installedAt is set when the installer ends; the state stays
	// installing until the installed boot has started.
	if vm.InstalledAt == "" || vm.State == "creating" || vm.State == "failed" {
		t.Fatalf("wait_for installed returned %s, installedAt %q", vm.State, vm.InstalledAt)
	}
	cluster.Eventually(t, 5*time.Minute, "the UKI guest ready", func() error {
		if vm = a.uki(vm.ID); vm.State != "ready" {
			return fmt.Errorf("state %s %s", vm.State, vm.LastError)
		}
		return nil
	})
	t.Logf("ready %s after create", time.Since(start).Round(time.Millisecond))
	att := vm.Attestation
	if att.Initrd == nil || !att.Initrd.Verified || att.Ready == nil || !att.Ready.Verified || !att.UserDataReleased {
		t.Fatalf("first boot not verified at both stages: %+v / %+v", att.Initrd, att.Ready)
	}
	if att.Initrd.LearnMode || len(att.Initrd.Learned) > 0 || len(att.Ready.Learned) > 0 || fmt.Sprint(att.Boot) != "1" {
		t.Errorf("verified with learned values or not on boot 1: %+v %+v boot %v", att.Initrd, att.Ready, att.Boot)
	}
	if !strings.Contains(att.Initrd.Message, "pcr 11 phase enter-initrd") ||
		!strings.Contains(att.Ready.Message, "pcr 11 phase enter-initrd:leave-initrd:sysinit:ready, pcr 13 kubernetes "+vm.KubernetesVersion) {
		t.Errorf("verdicts %q / %q", att.Initrd.Message, att.Ready.Message)
	}
	if vm.KubernetesVersion != tamper.goodKubernetes {
		t.Errorf("kubernetes version %q, want the newest offered, %s", vm.KubernetesVersion, tamper.goodKubernetes)
	}
	if got := strings.Join(transitions(t, c, vm.ID), " "); got != "creating>installing installing>booting booting>attesting attesting>ready" {
		t.Errorf("state changes %q", got)
	}
	// The guest applied the released user-data, and merged the sysext.
	if r := a.sh(vm.ID, "cat /etc/uki-secret; echo; /run/extensions/kubernetes_"+vm.KubernetesVersion+"/usr/bin/kubelet"); r.ExitCode != 0 ||
		r.Stdout != "released after attestation\nKubernetes v"+vm.KubernetesVersion+"\n" {
		t.Errorf("in the guest: %+v", r)
	}
	metrics := scrape(t, c)
	for _, family := range []string{"vm_manager_vm_install_seconds", "vm_manager_vm_boot_to_ready_seconds"} {
		m := regexp.MustCompile(family + `\{[^}]*vm="` + vm.ID + `"[^}]*\} ([0-9.e+-]+)`).FindStringSubmatch(metrics)
		if m == nil || m[1] == "0" {
			t.Errorf("no %s for %s in /metrics", family, vm.ID)
			continue
		}
		t.Logf("%s %s", family, m[1])
	}

	// The tampered boots: each refused, the PCR and the event named, and
	// the user-data kept from all but the sysext one (its initrd stage is
	// genuine: the sysext comes later).
	want := map[string][]string{
		"t-cmdline": {"initrd", "pcr 11 mismatch for phase enter-initrd", ".cmdline"},
		"t-initrd":  {"initrd", "pcr 11 mismatch for phase enter-initrd", ".initrd"},
		"t-disk":    {"initrd", "golden mismatch: pcr 4", "EFI application"},
		"t-sysext":  {"ready", "pcr 13", "kubernetes_" + tamper.badKubernetes + ".raw"},
	}
	var wg sync.WaitGroup
	for _, tc := range cases {
		wg.Go(func() {
			w := want[tc.name]
			var v ukiVM
			var q *quote
			cluster.Eventually(t, 5*time.Minute, tc.name+" attested", func() error {
				v = a.uki(ids[tc.name])
				if q = v.Attestation.Initrd; w[0] == "ready" {
					q = v.Attestation.Ready
				}
				if q == nil {
					return fmt.Errorf("state %s, no %s verdict yet", v.State, w[0])
				}
				return nil
			})
			if q.Verified || !strings.Contains(q.Message, w[1]) || !strings.Contains(q.Message, w[2]) {
				t.Errorf("%s: %s verdict %v %q, want a rejection naming %q and %q", tc.name, w[0], q.Verified, q.Message, w[1], w[2])
			}
			if len(q.MismatchedEvents) == 0 {
				t.Errorf("%s: no mismatched events listed", tc.name)
			}
			if released := v.Attestation.UserDataReleased; released != (tc.name == "t-sysext") {
				t.Errorf("%s: user data released %v", tc.name, released)
			}
			t.Logf("%s: %s", tc.name, q.Message)
		})
	}
	wg.Wait()
}

// transitions are the "vm state" lines the hypervisor logged for a VM.
func transitions(t *testing.T, c *cluster.Cluster, id string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(c.Dir, "hypervisor.log"))
	if err != nil {
		t.Fatal(err)
	}
	re := regexp.MustCompile(`msg="vm state" .*vm=` + id + ` .*from=(\S+) to=(\S+)`)
	var out []string
	for _, m := range re.FindAllStringSubmatch(string(b), -1) {
		out = append(out, m[1]+">"+m[2])
	}
	return out
}

func scrape(t *testing.T, c *cluster.Cluster) string {
	t.Helper()
	code, _, b := cluster.Do(t, "GET", "http://"+c.Addr+"/metrics", "")
	if code != 200 {
		t.Fatalf("/metrics: %d", code)
	}
	return string(b)
}

// tamperKit fills an image directory with the genuine UKI image and the
// tampered ones, all under the genuine image's policy.
type tamperKit struct {
	goodKubernetes, badKubernetes string
}

func newTamperKit(t *testing.T, src, dst string) *tamperKit {
	t.Helper()
	for _, ext := range []string{".efi", ".raw", ".policy.json"} {
		if err := os.Symlink(filepath.Join(src, ukiStem+ext), filepath.Join(dst, ukiStem+ext)); err != nil {
			t.Fatal(err)
		}
	}
	// The sysext tree, copied (the IMDS serves nothing outside it). The
	// older version's file no longer matches SHA256SUMS.
	k := &tamperKit{goodKubernetes: "1.34.2", badKubernetes: "1.33.6"}
	sums, err := os.ReadFile(filepath.Join(src, "sysupdate/kubernetes/SHA256SUMS"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(dst, "sysupdate/kubernetes"), 0o755); err != nil {
		t.Fatal(err)
	}
	copyFile(t, filepath.Join(src, "sysupdate/kubernetes/SHA256SUMS"), filepath.Join(dst, "sysupdate/kubernetes/SHA256SUMS"))
	for _, v := range []string{k.goodKubernetes, k.badKubernetes} {
		if !bytes.Contains(sums, []byte("kubernetes_"+v+".raw")) {
			t.Fatalf("SHA256SUMS lists no kubernetes %s:\n%s", v, sums)
		}
		name := filepath.Join("sysupdate/kubernetes", "kubernetes_"+v+".raw")
		copyFile(t, filepath.Join(src, name), filepath.Join(dst, name))
	}
	f, err := os.OpenFile(filepath.Join(dst, "sysupdate/kubernetes", "kubernetes_"+k.badKubernetes+".raw"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Write(make([]byte, 4096))
	f.Close()

	// The UKI's sections, to build the others from.
	sec := t.TempDir()
	uki, err := pe.Open(filepath.Join(src, ukiStem+".efi"))
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{".linux", ".initrd", ".cmdline", ".osrel"} {
		s := uki.Section(name)
		if s == nil {
			t.Fatalf("the UKI has no %s section", name)
		}
		b, err := io.ReadAll(io.LimitReader(s.Open(), int64(s.VirtualSize)))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(sec, name[1:]), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	uki.Close()
	cmdline, _ := os.ReadFile(filepath.Join(sec, "cmdline"))
	writeFile(t, filepath.Join(sec, "cmdline.tampered"), append(cmdline, " tampered=1"...))
	initrd, _ := os.ReadFile(filepath.Join(sec, "initrd"))
	writeFile(t, filepath.Join(sec, "initrd.tampered"), append(initrd, newc("etc/tampered", "a file the policy does not vouch for\n")...))

	var policy map[string]any
	if err := json.Unmarshal(readFile(t, filepath.Join(src, ukiStem+".policy.json")), &policy); err != nil {
		t.Fatal(err)
	}
	build := func(image, cmdlineFile, initrdFile string, env ...string) {
		stem := image + "_0.1.0"
		cmd := exec.Command("../hack/uki-image.sh", dst, stem, filepath.Join(sec, "linux"), filepath.Join(sec, initrdFile), filepath.Join(sec, cmdlineFile), filepath.Join(sec, "osrel"))
		cmd.Env = append(os.Environ(), env...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("uki-image.sh %s: %v\n%s", stem, err, out)
		}
		// The genuine image's policy, under this image's name.
		policy["image_id"] = image
		b, _ := json.Marshal(policy)
		writeFile(t, filepath.Join(dst, stem+".policy.json"), b)
	}
	build("cmdline-uki", "cmdline.tampered", "initrd")
	build("initrd-uki", "cmdline", "initrd.tampered")
	// The genuine UKI, but the disk boots it through another loader
	// (systemd-boot) first: PCR 11 is the genuine one, PCR 4 is not.
	build("disk-uki", "cmdline", "initrd", "UKI_LOADER=/usr/lib/systemd/boot/efi/systemd-bootx64.efi")
	return k
}

// newc is a cpio archive (newc, the initramfs format) with one file; the
// kernel unpacks archives appended to an initramfs over the first.
func newc(name, content string) []byte {
	var out bytes.Buffer
	entry := func(name string, mode int, data string, ino int) {
		fmt.Fprintf(&out, "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X", ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name)+1, 0)
		out.WriteString(name + "\x00")
		for out.Len()%4 != 0 {
			out.WriteByte(0)
		}
		out.WriteString(data)
		for out.Len()%4 != 0 {
			out.WriteByte(0)
		}
	}
	entry(name, 0o100644, content, 1)
	entry("TRAILER!!!", 0, "", 0)
	for out.Len()%512 != 0 {
		out.WriteByte(0)
	}
	return out.Bytes()
}

func readFile(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func writeFile(t *testing.T, p string, b []byte) {
	t.Helper()
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func copyFile(t *testing.T, from, to string) { t.Helper(); writeFile(t, to, readFile(t, from)) }
