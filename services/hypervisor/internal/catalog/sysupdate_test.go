package catalog

import (
	"path/filepath"
	"slices"
	"testing"
)

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

// An image with its own <stem>.sysupdate/ tree offers that tree's versions;
// the others keep the directory-wide tree.
func TestImageOwnSysupdateTree(t *testing.T) {
	dir := files(t, map[string]string{
		"a_1.efi": "", "a_1.raw": "", "b_1.efi": "", "b_1.raw": "",
		"sysupdate/kubernetes/SHA256SUMS":        "aaaa  kubernetes_1.33.6.raw\nbbbb  kubernetes_1.34.2.raw\n",
		"b_1.sysupdate/kubernetes/SHA256SUMS":    "cccc  kubernetes_1.34.3.raw\n",
		"b_1.sysupdate/kubernetes/kubernetes.x":  "",
		"c_1.sysupdate/kubernetes/SHA256SUMS":    "dddd  kubernetes_1.35.0.raw\n", // no image c_1
		"sysupdate/kubernetes/kubernetes_1.x.gz": "",
	})
	c, _ := load(t, dir)
	want := map[string]struct {
		dir      string
		versions []string
	}{
		"a_1": {filepath.Join(dir, "sysupdate"), []string{"1.34.2", "1.33.6"}},
		"b_1": {filepath.Join(dir, "b_1.sysupdate"), []string{"1.34.3"}},
	}
	for _, img := range c.List() {
		w := want[img.Ref]
		if img.SysupdateDir != w.dir || !slices.Equal(img.KubernetesVersions, w.versions) {
			t.Errorf("%s: tree %q %q, want %q %q", img.Ref, img.SysupdateDir, img.KubernetesVersions, w.dir, w.versions)
		}
	}
	if got := SysupdateDir(dir, "b_1"); got != filepath.Join(dir, "b_1.sysupdate") {
		t.Errorf("SysupdateDir(b_1) = %q", got)
	}
	if got := SysupdateDir(dir, "a_1"); got != filepath.Join(dir, "sysupdate") {
		t.Errorf("SysupdateDir(a_1) = %q", got)
	}
}
