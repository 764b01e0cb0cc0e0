package catalog

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/giantswarm/vm-manager/gen/apierr"
	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/logging/logtest"
)

// files writes name → content into a new temp directory.
func files(t *testing.T, fs map[string]string) string {
	t.Helper()
	dir := t.TempDir()
	for name, content := range fs {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func load(t *testing.T, dir string) (*Catalog, *logtest.Buffer) {
	t.Helper()
	logs := &logtest.Buffer{}
	c, err := Load(dir, slog.New(slog.NewTextHandler(logs, nil)))
	if err != nil {
		t.Fatalf("Load: %v", err)
	}
	return c, logs
}

func refs(images []*hypervisorv1.Image) []string {
	var out []string
	for _, img := range images {
		out = append(out, img.GetRef())
	}
	return out
}

func TestLoadImages(t *testing.T) {
	tests := []struct {
		name     string
		files    map[string]string
		wantRefs []string
		wantLogs []string
	}{
		{
			name:     "UKI pair",
			files:    map[string]string{"base_0.1.0.efi": "", "base_0.1.0.raw": ""},
			wantRefs: []string{"base_0.1.0"},
		},
		{
			name:     "kernel pair",
			files:    map[string]string{"test_1.vmlinuz": "", "test_1.initrd": ""},
			wantRefs: []string{"test_1"},
		},
		{
			name: "lone files are skipped with a warning",
			files: map[string]string{
				"a_1.efi": "", "b_1.raw": "", "c_1.vmlinuz": "", "d_1.initrd": "", "e_1.cmdline": "x",
				"ok_1.efi": "", "ok_1.raw": "",
			},
			wantRefs: []string{"ok_1"},
			wantLogs: []string{"a_1.efi", "b_1.raw", "c_1.vmlinuz", "d_1.initrd", "e_1.cmdline"},
		},
		{
			name:     "mixed halves do not pair",
			files:    map[string]string{"x_1.efi": "", "x_1.initrd": ""},
			wantLogs: []string{"x_1.efi", "x_1.initrd"},
		},
		{
			name:     "split at the last underscore",
			files:    map[string]string{"giant_swarm_base_0.2.0.efi": "", "giant_swarm_base_0.2.0.raw": ""},
			wantRefs: []string{"giant_swarm_base_0.2.0"},
		},
		{
			name: "stems that are not <id>_<version> are skipped",
			files: map[string]string{
				"noversion.efi": "", "noversion.raw": "",
				"_1.efi": "", "_1.raw": "",
				"trailing_.efi": "", "trailing_.raw": "",
				"bad name_1.efi": "", "bad name_1.raw": "",
			},
			wantLogs: []string{"noversion", "_1", "trailing_", "bad name_1"},
		},
		{
			name: "other files and directories are ignored",
			files: map[string]string{
				"base_1.roothash": "", "base_1.repart.d/x.conf": "", "README": "",
				"sysupdate/base/SHA256SUMS": "", "sub_1.efi/keep": "",
			},
		},
		{
			name: "sorted by id, newest version first",
			files: map[string]string{
				"zeta_1.0.efi": "", "zeta_1.0.raw": "",
				"alpha_0.9.0.efi": "", "alpha_0.9.0.raw": "",
				"alpha_0.10.0.vmlinuz": "", "alpha_0.10.0.initrd": "",
				"alpha_0.9.0-rc1.efi": "", "alpha_0.9.0-rc1.raw": "",
			},
			wantRefs: []string{"alpha_0.10.0", "alpha_0.9.0", "alpha_0.9.0-rc1", "zeta_1.0"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, logs := load(t, files(t, tt.files))
			if got := refs(c.List()); !slices.Equal(got, tt.wantRefs) {
				t.Errorf("refs = %q, want %q", got, tt.wantRefs)
			}
			out := logs.String()
			for _, want := range tt.wantLogs {
				if !strings.Contains(out, "level=WARN") || !strings.Contains(out, want) {
					t.Errorf("no warning naming %q in logs:\n%s", want, out)
				}
			}
			if len(tt.wantLogs) == 0 && strings.Contains(out, "level=WARN") {
				t.Errorf("unexpected warnings:\n%s", out)
			}
		})
	}
}

func TestImageFields(t *testing.T) {
	dir := files(t, map[string]string{
		"base_0.1.0.efi": "", "base_0.1.0.raw": "",
		"test_1.vmlinuz": "", "test_1.initrd": "",
		"custom_1.vmlinuz": "", "custom_1.initrd": "", "custom_1.cmdline": "  console=ttyS0\n  quiet  \n",
		"empty_1.vmlinuz": "", "empty_1.initrd": "", "empty_1.cmdline": "\n",
	})
	c, _ := load(t, dir)

	uki, err := c.Get("base_0.1.0")
	if err != nil {
		t.Fatal(err)
	}
	if uki.Id != "base" || uki.Version != "0.1.0" || uki.Kind != hypervisorv1.ImageKind_IMAGE_KIND_UKI ||
		uki.Uki != filepath.Join(dir, "base_0.1.0.efi") || uki.Disk != filepath.Join(dir, "base_0.1.0.raw") ||
		uki.Kernel != "" || uki.Cmdline != "" {
		t.Errorf("uki image = %v", uki)
	}
	if !filepath.IsAbs(uki.Uki) {
		t.Errorf("path %q is not absolute", uki.Uki)
	}

	for ref, cmdline := range map[string]string{
		"test_1":   DefaultCmdline,
		"custom_1": "console=ttyS0 quiet",
		"empty_1":  DefaultCmdline,
	} {
		k, err := c.Get(ref)
		if err != nil {
			t.Fatal(err)
		}
		if k.Kind != hypervisorv1.ImageKind_IMAGE_KIND_KERNEL || k.Kernel != filepath.Join(dir, ref+".vmlinuz") ||
			k.Initrd != filepath.Join(dir, ref+".initrd") || k.Uki != "" || k.Disk != "" {
			t.Errorf("%s = %v", ref, k)
		}
		if k.Cmdline != cmdline {
			t.Errorf("%s cmdline = %q, want %q", ref, k.Cmdline, cmdline)
		}
	}
}

func TestRelativeDirGivesAbsolutePaths(t *testing.T) {
	dir := files(t, map[string]string{"base_1.efi": "", "base_1.raw": ""})
	t.Chdir(filepath.Dir(dir))
	c, _ := load(t, filepath.Base(dir))
	img, err := c.Get("base_1")
	if err != nil {
		t.Fatal(err)
	}
	if img.Uki != filepath.Join(dir, "base_1.efi") {
		t.Errorf("uki = %q, want %q", img.Uki, filepath.Join(dir, "base_1.efi"))
	}
}

func TestBothKindsForOneStem(t *testing.T) {
	c, logs := load(t, files(t, map[string]string{
		"x_1.efi": "", "x_1.raw": "", "x_1.vmlinuz": "", "x_1.initrd": "",
	}))
	img, err := c.Get("x_1")
	if err != nil {
		t.Fatal(err)
	}
	if img.Kind != hypervisorv1.ImageKind_IMAGE_KIND_UKI {
		t.Errorf("kind = %v, want UKI", img.Kind)
	}
	if !strings.Contains(logs.String(), "both UKI and kernel") {
		t.Errorf("no warning: %s", logs.String())
	}
}

func TestGet(t *testing.T) {
	c, _ := load(t, files(t, map[string]string{
		"base_0.9.0.efi": "", "base_0.9.0.raw": "",
		"base_0.10.0.efi": "", "base_0.10.0.raw": "",
		"base_0.10.0-rc1.efi": "", "base_0.10.0-rc1.raw": "",
		"my_img_2.vmlinuz": "", "my_img_2.initrd": "",
	}))
	tests := []struct {
		ref      string
		wantRef  string
		wantCode apierr.Code
	}{
		{ref: "base_0.9.0", wantRef: "base_0.9.0"},
		{ref: "base_0.10.0-rc1", wantRef: "base_0.10.0-rc1"},
		{ref: "base", wantRef: "base_0.10.0"}, // bare id: newest version; a release beats its rc
		{ref: "my_img", wantRef: "my_img_2"},  // bare id containing '_'
		{ref: "my_img_2", wantRef: "my_img_2"},
		{ref: "base_0.8.0", wantCode: apierr.NotFound},
		{ref: "other", wantCode: apierr.NotFound},
		{ref: "", wantCode: apierr.InvalidRequest},
		{ref: "../base_0.9.0", wantCode: apierr.InvalidRequest},
		{ref: "base/0.9.0", wantCode: apierr.InvalidRequest},
		{ref: "base..0", wantCode: apierr.InvalidRequest},
		{ref: "base 0.9.0", wantCode: apierr.InvalidRequest},
		{ref: "base_0.9.0\n", wantCode: apierr.InvalidRequest},
		{ref: "bäse", wantCode: apierr.InvalidRequest},
		{ref: "a-b+c.d_1", wantCode: apierr.NotFound}, // every allowed character
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%q", tt.ref), func(t *testing.T) {
			img, err := c.Get(tt.ref)
			if tt.wantCode != "" {
				if img != nil || apierr.CodeOf(err) != tt.wantCode {
					t.Fatalf("Get = %v, %v (code %q); want code %q", img, err, apierr.CodeOf(err), tt.wantCode)
				}
				if tt.wantCode == apierr.NotFound {
					if want := fmt.Sprintf("image %q not found", tt.ref); err.Error() != want {
						t.Errorf("error = %q, want %q", err, want)
					}
					if !errors.Is(err, apierr.ErrNotFound) {
						t.Error("not errors.Is(err, apierr.ErrNotFound)")
					}
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if img.Ref != tt.wantRef {
				t.Errorf("ref = %q, want %q", img.Ref, tt.wantRef)
			}
		})
	}
}

func TestDefault(t *testing.T) {
	tests := []struct {
		name  string
		files []string // stems; UKI pairs are written
		want  string
	}{
		{name: "highest version overall", files: []string{"a_0.9.0", "b_0.10.0", "c_0.10.0-rc1"}, want: "b_0.10.0"},
		{name: "a tie goes to the first id", files: []string{"zeta_2.0", "beta_2.0", "alpha_1.0"}, want: "beta_2.0"},
		{name: "release above its rc", files: []string{"a_1.0.0-rc1", "a_1.0.0"}, want: "a_1.0.0"},
		{name: "numeric, not lexical", files: []string{"a_9", "a_10"}, want: "a_10"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := map[string]string{}
			for _, stem := range tt.files {
				fs[stem+".efi"], fs[stem+".raw"] = "", ""
			}
			c, _ := load(t, files(t, fs))
			img, err := c.Default()
			if err != nil {
				t.Fatal(err)
			}
			if img.Ref != tt.want {
				t.Errorf("default = %q, want %q", img.Ref, tt.want)
			}
		})
	}
}

func TestMissingDirectory(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "images")
	c, _ := load(t, dir)
	if got := c.List(); len(got) != 0 {
		t.Errorf("List = %v", got)
	}
	if _, err := c.Default(); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("Default error = %v, want not_found", err)
	}
	if _, err := c.Get("base"); apierr.CodeOf(err) != apierr.NotFound {
		t.Errorf("Get error = %v, want not_found", err)
	}

	// Images added later appear on Refresh.
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"base_1.efi", "base_1.raw"} {
		if err := os.WriteFile(filepath.Join(dir, name), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := c.Refresh(); err != nil {
		t.Fatal(err)
	}
	if got := refs(c.List()); !slices.Equal(got, []string{"base_1"}) {
		t.Errorf("after Refresh: %q", got)
	}
}

func TestLoadErrors(t *testing.T) {
	// A file where the directory should be is an error, not an empty catalog.
	f := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(f, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(f, nil); err == nil {
		t.Error("Load of a regular file succeeded")
	}
}

func TestKubernetesVersions(t *testing.T) {
	tests := []struct {
		name          string
		sums          *string // nil = no file
		wantVersions  []string
		wantSysupdate bool
	}{
		{name: "no sysupdate tree"},
		{
			name: "sorted newest first",
			sums: ptr("aaaa  kubernetes_v1.33.2.raw\n" +
				"bbbb  kubernetes_v1.34.0.raw\n" +
				"cccc  kubernetes_v1.9.10.raw\n" +
				"dddd  kubernetes_v1.34.0-rc.1.raw\n" +
				"eeee *kubernetes_v1.33.10.raw\n" + // binary-mode marker
				"ffff  kubernetes_v1.34.0.raw\n" + // duplicate
				"0000  base_0.1.0.raw\n" + // not kubernetes
				"1111  kubernetes_v1.32.0.raw.gpg\n" + // not a .raw
				"garbage line with words\n"),
			wantVersions:  []string{"v1.34.0", "v1.34.0-rc.1", "v1.33.10", "v1.33.2", "v1.9.10"},
			wantSysupdate: true,
		},
		{name: "empty file", sums: ptr(""), wantSysupdate: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := map[string]string{"a_1.efi": "", "a_1.raw": "", "b_1.vmlinuz": "", "b_1.initrd": ""}
			if tt.sums != nil {
				fs["sysupdate/kubernetes/SHA256SUMS"] = *tt.sums
			}
			dir := files(t, fs)
			c, _ := load(t, dir)
			for _, img := range c.List() {
				if !slices.Equal(img.KubernetesVersions, tt.wantVersions) {
					t.Errorf("%s kubernetes versions = %q, want %q", img.Ref, img.KubernetesVersions, tt.wantVersions)
				}
				wantDir := ""
				if tt.wantSysupdate {
					wantDir = filepath.Join(dir, "sysupdate")
				}
				if img.SysupdateDir != wantDir {
					t.Errorf("%s sysupdate dir = %q, want %q", img.Ref, img.SysupdateDir, wantDir)
				}
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }

func TestPolicy(t *testing.T) {
	const (
		own    = `{"pcr11": {"enter-initrd": "01"}, "source": "own"}`
		shared = `{"pcr11": {"enter-initrd": "02"}, "source": "shared"}`
	)
	tests := []struct {
		name       string
		files      map[string]string
		wantSource string // "" = no policy
		wantWarn   string
	}{
		{name: "none"},
		{
			name:       "own policy",
			files:      map[string]string{"base_1.policy.json": own},
			wantSource: "own",
		},
		{
			name:       "own policy beats the shared one",
			files:      map[string]string{"base_1.policy.json": own, "policy.json": shared},
			wantSource: "own",
		},
		{
			name:       "shared without image keys",
			files:      map[string]string{"policy.json": shared},
			wantSource: "shared",
		},
		{
			name:       "shared with matching keys",
			files:      map[string]string{"policy.json": `{"image_id": "base", "image_version": "1", "source": "shared"}`},
			wantSource: "shared",
		},
		{
			name:       "shared with matching id only",
			files:      map[string]string{"policy.json": `{"image_id": "base", "source": "shared"}`},
			wantSource: "shared",
		},
		{
			name:  "shared for another image id",
			files: map[string]string{"policy.json": `{"image_id": "other", "image_version": "1", "source": "shared"}`},
		},
		{
			name:  "shared for another version",
			files: map[string]string{"policy.json": `{"image_id": "base", "image_version": "2", "source": "shared"}`},
		},
		{
			name:  "shared with a non-string image_id",
			files: map[string]string{"policy.json": `{"image_id": 1, "source": "shared"}`},
		},
		{
			name:     "invalid own policy: nil, no fallback to shared",
			files:    map[string]string{"base_1.policy.json": `{"pcr11": `, "policy.json": shared},
			wantWarn: "image policy ignored",
		},
		{
			name:     "own policy that is not an object",
			files:    map[string]string{"base_1.policy.json": `[1, 2]`},
			wantWarn: "image policy ignored",
		},
		{
			name:     "invalid shared policy",
			files:    map[string]string{"policy.json": `nope`},
			wantWarn: "shared policy ignored",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			fs := map[string]string{"base_1.efi": "", "base_1.raw": ""}
			for k, v := range tt.files {
				fs[k] = v
			}
			c, logs := load(t, files(t, fs))
			img, err := c.Get("base_1")
			if err != nil {
				t.Fatalf("Get: %v (the catalog must survive a bad policy)", err)
			}
			doc, ok := c.PolicyDocument("base_1")
			if tt.wantSource == "" {
				if img.Policy != nil || ok || doc != nil {
					t.Errorf("policy = %v, document %q %v; want none", img.Policy, doc, ok)
				}
			} else {
				if got := img.Policy.GetFields()["source"].GetStringValue(); got != tt.wantSource {
					t.Errorf("policy source = %q, want %q", got, tt.wantSource)
				}
				if !ok || !strings.Contains(string(doc), `"source": "`+tt.wantSource+`"`) {
					t.Errorf("document = %q, %v", doc, ok)
				}
			}
			if tt.wantWarn != "" && !strings.Contains(logs.String(), tt.wantWarn) {
				t.Errorf("logs lack %q:\n%s", tt.wantWarn, logs.String())
			}
		})
	}
}

func TestPolicyDocumentLookup(t *testing.T) {
	c, _ := load(t, files(t, map[string]string{
		"base_1.efi": "", "base_1.raw": "", "base_1.policy.json": `{"v": "1"}`,
		"base_2.efi": "", "base_2.raw": "", "base_2.policy.json": `{"v": "2"}`,
	}))
	if doc, ok := c.PolicyDocument("base"); !ok || string(doc) != `{"v": "2"}` {
		t.Errorf("bare id: %q %v", doc, ok)
	}
	if doc, ok := c.PolicyDocument("base_1"); !ok || string(doc) != `{"v": "1"}` {
		t.Errorf("ref: %q %v", doc, ok)
	}
	for _, ref := range []string{"base_3", "../base_1", ""} {
		if doc, ok := c.PolicyDocument(ref); ok || doc != nil {
			t.Errorf("PolicyDocument(%q) = %q, %v", ref, doc, ok)
		}
	}
	// The returned bytes are a copy.
	doc, _ := c.PolicyDocument("base_1")
	doc[0] = 'X'
	if again, _ := c.PolicyDocument("base_1"); string(again) != `{"v": "1"}` {
		t.Errorf("catalog document changed through a returned slice: %q", again)
	}
}

func TestReturnsClones(t *testing.T) {
	c, _ := load(t, files(t, map[string]string{
		"base_1.efi": "", "base_1.raw": "", "base_1.policy.json": `{"k": "v"}`,
		"sysupdate/kubernetes/SHA256SUMS": "aa  kubernetes_v1.raw\n",
	}))
	img, _ := c.Get("base_1")
	img.Uki = "/tmp/evil"
	img.KubernetesVersions[0] = "evil"
	img.Policy.Fields["k"] = nil
	c.List()[0].Disk = "/tmp/evil"
	d, _ := c.Default()
	d.Version = "evil"

	again, _ := c.Get("base_1")
	if strings.Contains(again.Uki, "evil") || strings.Contains(again.Disk, "evil") || again.Version != "1" ||
		again.KubernetesVersions[0] != "v1" || again.Policy.GetFields()["k"].GetStringValue() != "v" {
		t.Errorf("catalog mutated through a returned image: %v", again)
	}
}

func TestRefreshConcurrent(t *testing.T) {
	dir := files(t, map[string]string{"base_1.efi": "", "base_1.raw": ""})
	c, _ := load(t, dir)
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Go(func() {
			for range 50 {
				if _, err := c.Get("base"); err != nil {
					t.Error(err)
					return
				}
				c.List()
				if i == 0 {
					if err := c.Refresh(); err != nil {
						t.Error(err)
						return
					}
				}
			}
		})
	}
	wg.Wait()

	if err := os.WriteFile(filepath.Join(dir, "base_2.efi"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "base_2.raw"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if img, _ := c.Get("base"); img.Ref != "base_1" {
		t.Errorf("before Refresh: %q", img.Ref)
	}
	if err := c.Refresh(); err != nil {
		t.Fatal(err)
	}
	if img, _ := c.Get("base"); img.Ref != "base_2" {
		t.Errorf("after Refresh: %q", img.Ref)
	}

	// A failing reload keeps the previous catalog.
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := c.Refresh(); err == nil {
		t.Error("Refresh of a regular file succeeded")
	}
	if got := refs(c.List()); !slices.Equal(got, []string{"base_2", "base_1"}) {
		t.Errorf("after a failed Refresh: %q", got)
	}
}
