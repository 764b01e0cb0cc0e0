package catalog

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

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
