package catalog

import (
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/logging/logtest"
	"github.com/giantswarm/vm-manager/sdk/apierr"
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
