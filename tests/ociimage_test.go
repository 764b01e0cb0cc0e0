package tests

import (
	"archive/tar"
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/client"
	"github.com/giantswarm/vm-manager/tests/cluster"
)

// ociRegistry serves an OCI registry on loopback, in-process.
func ociRegistry(t testing.TB) string {
	t.Helper()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// pythonRootfs is the root file system of the test's Python image: Debian's
// python3 and busybox, unpacked by hack/oci-test-rootfs.sh (cached).
func pythonRootfs(t testing.TB) string {
	t.Helper()
	out, err := exec.Command("../hack/oci-test-rootfs.sh").Output()
	if err != nil {
		msg := err.Error()
		if ee, ok := err.(*exec.ExitError); ok {
			msg += ": " + string(ee.Stderr)
		}
		t.Fatalf("hack/oci-test-rootfs.sh: %s", msg)
	}
	return strings.TrimSpace(string(out))
}

// tarDir writes dir's tree as a tar file, owners kept.
func tarDir(t testing.TB, dir, out string) {
	t.Helper()
	f, err := os.Create(out)
	if err != nil {
		t.Fatal(err)
	}
	tw := tar.NewWriter(f)
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == dir {
			return err
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		link := ""
		if fi.Mode()&fs.ModeSymlink != 0 {
			if link, err = os.Readlink(p); err != nil {
				return err
			}
		}
		h, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			return err
		}
		h.Name, _ = filepath.Rel(dir, p)
		if fi.IsDir() {
			h.Name += "/"
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			h.Uid, h.Gid = int(st.Uid), int(st.Gid)
		}
		h.Uname, h.Gname = "", ""
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		if fi.Mode().IsRegular() {
			in, err := os.Open(p)
			if err != nil {
				return err
			}
			defer in.Close()
			_, err = io.Copy(tw, in)
			return err
		}
		return nil
	})
	if err == nil {
		err = tw.Close()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatal(err)
	}
}

// filesLayer is a layer of name→content files (mode 0755 when the name
// ends in .sh).
func filesLayer(t testing.TB, files map[string]string) v1.Layer {
	t.Helper()
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	for n, body := range files {
		mode := int64(0o644)
		if strings.HasSuffix(n, ".sh") {
			mode = 0o755
		}
		tw.WriteHeader(&tar.Header{Name: n, Typeflag: tar.TypeReg, Mode: mode, Size: int64(len(body))})
		tw.Write([]byte(body))
	}
	tw.Close()
	l, err := tarball.LayerFromReader(bytes.NewReader(b.Bytes()))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// pushImage pushes an image of layers with cfg to ref; it returns the
// manifest digest.
func pushImage(t testing.TB, ref string, cfg v1.Config, layers ...v1.Layer) string {
	t.Helper()
	img, err := mutate.AppendLayers(empty.Image, layers...)
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Config = "linux", "amd64", cfg
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		t.Fatal(err)
	}
	img = mutate.MediaType(img, types.OCIManifestSchema1)
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(r, img); err != nil {
		t.Fatalf("push %s: %v", ref, err)
	}
	d, err := img.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return d.String()
}

// importLine is one NDJSON line of POST /api/v1/images:import.
type importLine struct {
	Result *struct {
		Phase      string `json:"phase"`
		BytesDone  int64  `json:"bytesDone"`
		BytesTotal int64  `json:"bytesTotal"`
		Unchanged  bool   `json:"unchanged"`
		Image      *struct {
			Ref  string `json:"ref"`
			Kind string `json:"kind"`
			Oci  struct {
				Reference      string `json:"reference"`
				ManifestDigest string `json:"manifestDigest"`
				RootHash       string `json:"rootHash"`
				Root           string `json:"root"`
				RootVerity     string `json:"rootVerity"`
				StoredBytes    int64  `json:"storedBytes"`
			} `json:"oci"`
		} `json:"image"`
	} `json:"result"`
	Error *struct {
		Code    any    `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

// importImage imports over REST and returns the phases seen and the last line.
func (a api) importImage(body string) ([]string, importLine) {
	a.t.Helper()
	return importOCI(a.t, a.base, body)
}

func importOCI(t testing.TB, base, body string) ([]string, importLine) {
	t.Helper()
	code, _, b := cluster.Do(t, "POST", base+"/images:import", body)
	if code != 200 {
		return nil, importLine{Error: &struct {
			Code    any    `json:"code"`
			Message string `json:"message"`
		}{Code: code, Message: string(b)}}
	}
	var phases []string
	var last importLine
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var l importLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("import line %q: %v", sc.Text(), err)
		}
		if l.Result != nil && (len(phases) == 0 || phases[len(phases)-1] != l.Result.Phase) {
			phases = append(phases, l.Result.Phase)
		}
		last = l
	}
	return phases, last
}

// ociImageDir is an image directory of its own (imports write into it)
// holding the test guest, whose kernel and initrd boot OCI images.
func ociImageDir(t testing.TB) string {
	t.Helper()
	src := cluster.GuestImages(t, "..")
	dir := t.TempDir()
	matches, _ := filepath.Glob(filepath.Join(src, "test-guest_*"))
	for _, m := range matches {
		if err := os.Symlink(m, filepath.Join(dir, filepath.Base(m))); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// ociVM is what the test reads of a VM of an OCI image.
type ociVM struct {
	ukiVM
	OciImage struct {
		Reference      string `json:"reference"`
		ManifestDigest string `json:"manifestDigest"`
		RootHash       string `json:"rootHash"`
	} `json:"ociImage"`
}

func (a api) ociVM(id string) ociVM {
	a.t.Helper()
	code, _, b := cluster.Do(a.t, "GET", a.base+"/vms/"+id, "")
	var v ociVM
	if code != 200 || json.Unmarshal(b, &v) != nil {
		a.t.Fatalf("get %s: %d %s", id, code, b)
	}
	return v
}

// TestOCIImage imports an OCI image built here from Debian's python3 and
// pushed to a registry on loopback, boots a VM of it and checks what the
// issue promises: the entrypoint runs as the image's user with its env and
// working directory, its output is in the console, exec finds the image's
// python3, the verdict names the manifest digest, and a VM whose root was
// changed on the host, or swapped for another image's, is refused naming
// both root hashes. Hostile images are refused, naming layer and entry, and
// leave nothing behind.
func TestOCIImage(t *testing.T) {
	dir := ociImageDir(t)
	rootfs := pythonRootfs(t)
	host := ociRegistry(t)
	base := filepath.Join(t.TempDir(), "rootfs.tar")
	tarDir(t, rootfs, base)
	baseLayer, err := tarball.LayerFromFile(base)
	if err != nil {
		t.Fatal(err)
	}
	cfg := v1.Config{
		Entrypoint: []string{"python3", "-u", "-c"},
		Cmd:        []string{"import os, time; print('entrypoint:', os.environ['GREETING'], os.getuid(), os.getcwd()); time.sleep(1e6)"},
		Env:        []string{"PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hello-oci"},
		User:       "app",
		WorkingDir: "/home/app",
	}
	good := pushImage(t, host+"/python:3.11", cfg, baseLayer, filesLayer(t, map[string]string{"home/app/README": "the app\n"}))

	c := cluster.Start(t, cluster.Processes, binDir, cluster.Options{ImageDir: dir, Quiet: true})
	a := api{t: t, base: "http://" + c.Addr + "/api/v1"}
	t.Cleanup(func() { killVMs(t, c, a) })

	// An agent, through MCP alone: import (with progress), create, run
	// Python, read the verdict.
	var progressMu sync.Mutex
	var progress []string
	cs := mcpSession(t, c.Addr, "", func(p *mcp.ProgressNotificationParams) {
		if p.ProgressToken == "import_image-progress" {
			progressMu.Lock()
			progress = append(progress, p.Message)
			progressMu.Unlock()
		}
	})
	var imported struct {
		Image struct {
			Ref  string `json:"ref"`
			Kind string `json:"kind"`
			Oci  struct {
				ManifestDigest string `json:"manifestDigest"`
				RootHash       string `json:"rootHash"`
				StoredBytes    int64  `json:"storedBytes"`
			} `json:"oci"`
		} `json:"image"`
		Unchanged bool `json:"unchanged"`
	}
	if err := json.Unmarshal([]byte(callTool(t, cs, "import_image", map[string]any{"source": host + "/python:3.11"}, false)), &imported); err != nil {
		t.Fatal(err)
	}
	img := imported.Image
	if img.Ref != "python_3.11" || img.Kind != "oci" || img.Oci.ManifestDigest != good || len(img.Oci.RootHash) != 64 || imported.Unchanged {
		t.Fatalf("import_image: %+v, want python_3.11 of %s", imported, good)
	}
	cluster.Eventually(t, 10*time.Second, "the import's progress notifications", func() error {
		progressMu.Lock()
		defer progressMu.Unlock()
		all := strings.Join(progress, " | ")
		for _, want := range []string{"layers ", "measuring"} {
			if !strings.Contains(all, want) {
				return fmt.Errorf("no %q in %q", want, all)
			}
		}
		return nil
	})
	t.Logf("imported %s: root %s, %d bytes stored", img.Ref, img.Oci.RootHash, img.Oci.StoredBytes)
	// The same manifest again, over REST: unchanged, and the stream's phases.
	if phases, l := a.importImage(fmt.Sprintf(`{"source":%q}`, host+"/python:3.11")); l.Result == nil || !l.Result.Unchanged ||
		strings.Join(phases, " ") != "resolving done" {
		t.Errorf("second import: phases %v, %+v", phases, l)
	}

	// Hostile images: refused, naming the layer and the entry; nothing left.
	before := dirNames(t, dir)
	for _, h := range hostileImages(t, host) {
		_, l := a.importImage(fmt.Sprintf(`{"source":%q}`, h.source))
		if l.Error == nil || fmt.Sprint(l.Error.Code) != "invalid_request" ||
			!strings.Contains(l.Error.Message, h.layer) || !strings.Contains(l.Error.Message, h.entry) {
			t.Errorf("%s: %+v; want invalid_request naming layer %s and %q", h.name, l.Error, h.layer, h.entry)
		}
	}
	if after := dirNames(t, dir); strings.Join(after, " ") != strings.Join(before, " ") {
		t.Errorf("refused imports changed the image directory: %v, then %v", before, after)
	}

	// The same image under two more ids: one whose root is changed on the
	// host after the import, one whose root is swapped for other content.
	for _, id := range []string{"pytamper", "pyswap"} {
		if _, l := a.importImage(fmt.Sprintf(`{"source":%q,"id":%q}`, host+"/python:3.11", id)); l.Result == nil || l.Result.Phase != "done" {
			t.Fatalf("import as %s: %+v", id, l)
		}
	}
	// The tag now names other content: importing it again under the same
	// id and version is a conflict; under another id, a new image.
	other := pushImage(t, host+"/python:3.11", cfg, baseLayer, filesLayer(t, map[string]string{"home/app/README": "other content\n"}))
	if _, l := a.importImage(fmt.Sprintf(`{"source":%q}`, host+"/python:3.11")); l.Error == nil || !strings.Contains(l.Error.Message, good) {
		t.Errorf("re-tagged import into python_3.11: %+v, want a conflict naming %s", l, good)
	}
	_, l := a.importImage(fmt.Sprintf(`{"source":%q,"id":"pyother"}`, host+"/python:3.11"))
	if l.Result == nil || l.Result.Image == nil || l.Result.Image.Oci.ManifestDigest != other {
		t.Fatalf("import of the re-tagged image: %+v", l)
	}
	otherRoot := l.Result.Image.Oci.RootHash
	flipByte(t, filepath.Join(dir, "pytamper_3.11.erofs"))
	for _, ext := range []string{".erofs", ".verity"} {
		copyFile(t, filepath.Join(dir, "pyother_3.11"+ext), filepath.Join(dir, "pyswap_3.11"+ext))
	}

	ids := map[string]string{}
	for _, n := range []string{"pytamper", "pyswap"} {
		ids[n] = a.vm("POST", "/vms", fmt.Sprintf(`{"name":%q,"image":%q,"memory_mib":512,"cpus":1,"wait_for":"none"}`, n, n), 201).ID
	}
	var created struct {
		ID, State string
	}
	if err := json.Unmarshal([]byte(callTool(t, cs, "create_vm", map[string]any{"name": "python", "image": "python", "memory_mib": 512, "cpus": 1, "wait_for": "ready"}, false)), &created); err != nil || created.State != "ready" {
		t.Fatalf("create_vm: %+v %v", created, err)
	}
	var ex execJSON
	if err := json.Unmarshal([]byte(callTool(t, cs, "exec_vm", map[string]any{"id": created.ID, "command": []string{"python3", "-c", "print(6*7)"}}, false)), &ex); err != nil || ex.ExitCode != 0 || ex.Stdout != "42\n" {
		t.Errorf("exec_vm python3 -c 'print(6*7)': %+v %v", ex, err)
	}
	if got := callTool(t, cs, "get_vm_attestation", map[string]any{"id": created.ID}, false); !strings.Contains(got, good) || !strings.Contains(got, img.Oci.RootHash) {
		t.Errorf("get_vm_attestation does not name %s and root %s: %s", good, img.Oci.RootHash, got)
	}
	vm := a.ociVM(created.ID)
	if q := vm.Attestation.Initrd; q == nil || !q.Verified || !strings.Contains(q.Message, good) {
		t.Errorf("initrd verdict %+v: want verified, naming %s", q, good)
	}
	if vm.OciImage.ManifestDigest != good || vm.OciImage.RootHash != img.Oci.RootHash {
		t.Errorf("the VM names %+v, want %s root %s", vm.OciImage, good, img.Oci.RootHash)
	}
	if r := a.sh(vm.ID, "id -u; pwd; echo $GREETING; cat README"); r.ExitCode != 0 || r.Stdout != "1000\n/home/app\nhello-oci\nthe app\n" {
		t.Errorf("exec in the image: %+v", r)
	}
	// Suspend and resume work on it as on any VM: the same boot carries on,
	// its root and overlay attached as before.
	a.vm("POST", "/vms/"+vm.ID+"/suspend", "", 200)
	a.vm("POST", "/vms/"+vm.ID+"/resume", "", 200)
	cluster.Eventually(t, 2*time.Minute, "exec after the resume", func() error {
		code, _, b := cluster.Do(t, "POST", a.base+"/vms/"+vm.ID+"/exec", `{"command":["python3","-c","print(6*7)"]}`)
		var r execJSON
		if code != 200 || json.Unmarshal(b, &r) != nil || r.Stdout != "42\n" {
			return fmt.Errorf("%d %s", code, b)
		}
		return nil
	})
	// Streamed exec runs in the image too, stdin and all.
	cl, err := client.Dial(c.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	se := openExec(t, cl, &hypervisorv1.ExecStart{Id: vm.ID, Command: []string{"python3", "-c", "import sys; print(sys.stdin.readline().strip() * 2)"}})
	se.stdin("ab\n")
	if exit := se.wait(); exit.GetExitCode() != 0 || se.out() != "abab\n" {
		t.Errorf("streamed exec: exit %v, output %q", exit, se.out())
	}
	// A port forward reaches a server the image runs (busybox's httpd,
	// serving the app's directory).
	if r := a.sh(vm.ID, "busybox httpd -p 8080 -h /home/app"); r.ExitCode != 0 {
		t.Fatalf("httpd: %+v", r)
	}
	fwd := a.forward(vm.ID, 8080)
	cluster.Eventually(t, time.Minute, "the image's httpd through the forward", func() error {
		resp, err := http.Get("http://" + fwd + "/README")
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 || string(b) != "the app\n" {
			return fmt.Errorf("%d %q", resp.StatusCode, b)
		}
		return nil
	})
	cluster.Eventually(t, time.Minute, "the entrypoint's output in the console", func() error {
		var con struct {
			Console string `json:"console"`
		}
		getJSON(t, a.base+"/vms/"+vm.ID+"/console?lines=500", &con)
		if !strings.Contains(con.Console, "entrypoint: hello-oci 1000 /home/app") {
			return fmt.Errorf("not yet")
		}
		return nil
	})

	// The tampered ones: refused at attestation, naming the root hash the
	// policy expects and the one the guest measured. (The swapped root is
	// hashed with the command line's salt and size, the image's: its
	// measured hash is neither root's.)
	if otherRoot == img.Oci.RootHash {
		t.Fatal("the re-tagged image has the same root")
	}
	for n, want := range map[string][]string{
		"pytamper": {img.Oci.RootHash, "the guest measured root hash"},
		"pyswap":   {img.Oci.RootHash, "the guest measured root hash"},
	} {
		var v ociVM
		cluster.Eventually(t, 6*time.Minute, n+" attested", func() error {
			if v = a.ociVM(ids[n]); v.Attestation.Initrd == nil {
				return fmt.Errorf("state %s, no initrd verdict yet", v.State)
			}
			return nil
		})
		q := v.Attestation.Initrd
		if q.Verified || !strings.Contains(q.Message, "verity root") {
			t.Errorf("%s: verdict %v %q, want a refusal naming the verity root", n, q.Verified, q.Message)
		}
		for _, h := range want {
			if !strings.Contains(q.Message, h) {
				t.Errorf("%s: verdict %q does not name root hash %s", n, q.Message, h)
			}
		}
		t.Logf("%s: %s", n, q.Message)
	}
	// A lifetime ends an OCI image's VM as any other's: a short ttl stops it.
	a.lifetimeVM("POST", "/vms/"+ids["pytamper"]+"/lifetime", `{"ttl":"5s","on_expire":"stop"}`, 200)
	a.waitStopped(ids["pytamper"], 2*time.Minute)
}

func dirNames(t testing.TB, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range es {
		out = append(out, e.Name())
	}
	return out
}

// flipByte changes one byte in the middle of a file.
func flipByte(t testing.TB, path string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fi, _ := f.Stat()
	b := make([]byte, 1)
	off := fi.Size() / 2
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	b[0] ^= 0x01
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

type hostile struct {
	name, source, layer, entry string
}

// hostileImages pushes one image per hostile layer to the registry.
func hostileImages(t testing.TB, host string) []hostile {
	t.Helper()
	var out []hostile
	for _, h := range []struct {
		name, entry string
		hdrs        []*tar.Header
	}{
		{"traversal", "../../etc/shadow", []*tar.Header{{Name: "../../etc/shadow", Typeflag: tar.TypeReg, Mode: 0o644}}},
		{"device", "dev/sda", []*tar.Header{{Name: "dev/sda", Typeflag: tar.TypeBlock, Mode: 0o600, Devmajor: 8}}},
		{"symlink-out", "evil", []*tar.Header{{Name: "evil", Typeflag: tar.TypeSymlink, Linkname: "../../../etc", Mode: 0o777}, {Name: "evil/passwd", Typeflag: tar.TypeReg, Mode: 0o644}}},
	} {
		var b bytes.Buffer
		tw := tar.NewWriter(&b)
		for _, hd := range h.hdrs {
			tw.WriteHeader(hd)
		}
		tw.Close()
		l, err := tarball.LayerFromReader(bytes.NewReader(b.Bytes()))
		if err != nil {
			t.Fatal(err)
		}
		d, _ := l.Digest()
		ref := host + "/hostile-" + h.name + ":1"
		pushImage(t, ref, v1.Config{Cmd: []string{"/x"}}, l)
		out = append(out, hostile{name: h.name, source: ref, layer: d.String(), entry: h.entry})
	}
	return out
}
