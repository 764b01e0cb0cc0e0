package host

import (
	"context"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestReportOVMF(t *testing.T) {
	tests := []struct {
		name              string
		files             []string
		code, vars        string // Config overrides
		wantCode, wantVar string
		wantMissing       []string
		wantWarning       string
	}{
		{
			name:     "first pair wins",
			files:    []string{"edk2/x64/OVMF_CODE.4m.fd", "edk2/x64/OVMF_VARS.4m.fd", "OVMF/OVMF_CODE_4M.fd", "OVMF/OVMF_VARS_4M.fd"},
			wantCode: "edk2/x64/OVMF_CODE.4m.fd", wantVar: "edk2/x64/OVMF_VARS.4m.fd",
		},
		{
			name:     "a code image without its vars is skipped",
			files:    []string{"edk2/x64/OVMF_CODE.4m.fd", "OVMF/OVMF_CODE.fd", "OVMF/OVMF_VARS.fd"},
			wantCode: "OVMF/OVMF_CODE.fd", wantVar: "OVMF/OVMF_VARS.fd",
		},
		{
			name:        "none",
			wantMissing: []string{"OVMF code image not found"},
		},
		{
			name:     "configured, vars derived",
			files:    []string{"custom/MY_CODE.fd", "custom/MY_VARS.fd", "OVMF/OVMF_CODE.fd", "OVMF/OVMF_VARS.fd"},
			code:     "custom/MY_CODE.fd",
			wantCode: "custom/MY_CODE.fd", wantVar: "custom/MY_VARS.fd",
		},
		{
			name:     "configured, both",
			files:    []string{"custom/a.fd", "custom/b.fd"},
			code:     "custom/a.fd",
			vars:     "custom/b.fd",
			wantCode: "custom/a.fd", wantVar: "custom/b.fd",
		},
		{
			name:        "configured, vars missing",
			files:       []string{"custom/a.fd"},
			code:        "custom/a.fd",
			wantCode:    "custom/a.fd",
			wantWarning: "OVMF variable store template for {root}/custom/a.fd not found",
		},
		{
			name:        "configured but missing: the pairs are not probed",
			files:       []string{"OVMF/OVMF_CODE.fd", "OVMF/OVMF_VARS.fd"},
			code:        "custom/gone.fd",
			wantMissing: []string{"OVMF code image {root}/custom/gone.fd"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeHost(t)
			for _, p := range tt.files {
				f.write(p, p)
			}
			cfg := f.config()
			abs := func(rel string) string {
				if rel == "" {
					return ""
				}
				return f.path(rel)
			}
			cfg.OVMFCode, cfg.OVMFVars = abs(tt.code), abs(tt.vars)
			h := New(cfg).Report(context.Background())
			if h.OvmfCode != abs(tt.wantCode) || h.OvmfVars != abs(tt.wantVar) {
				t.Errorf("ovmf = %q, %q; want %q, %q", h.OvmfCode, h.OvmfVars, abs(tt.wantCode), abs(tt.wantVar))
			}
			var wantMissing []string
			for _, m := range tt.wantMissing {
				wantMissing = append(wantMissing, strings.ReplaceAll(m, "{root}", f.root))
			}
			if !slices.Equal(h.Missing, wantMissing) || h.Ready != (len(wantMissing) == 0) {
				t.Errorf("ready=%v missing = %q, want %q", h.Ready, h.Missing, wantMissing)
			}
			if tt.wantWarning != "" && !slices.Contains(h.Warnings, strings.ReplaceAll(tt.wantWarning, "{root}", f.root)) {
				t.Errorf("warnings = %q, want %q", h.Warnings, tt.wantWarning)
			}
			if tt.wantCode != "" && h.Firmware.Sha256 != sha(tt.wantCode) {
				t.Errorf("firmware sha256 = %q, want sha256(%q)", h.Firmware.Sha256, tt.wantCode)
			}
		})
	}
}

func TestFirmwarePackage(t *testing.T) {
	tests := []struct {
		name               string
		search, show       string // "" = command fails
		wantPkg, wantVer   string
		wantErrContains    string
		wantNoErrorMessage bool
	}{
		{name: "plain", search: "ovmf: {code}\n", show: "2025.02-8", wantPkg: "ovmf", wantVer: "2025.02-8", wantNoErrorMessage: true},
		{name: "diversion and shared", search: "diversion by x from: {code}\nedk2-ovmf, other: {code}\n", show: "1.0\n", wantPkg: "edk2-ovmf", wantVer: "1.0", wantNoErrorMessage: true},
		{name: "not from a package", search: "", wantErrContains: "dpkg-query --search"},
		{name: "show fails", search: "ovmf: {code}\n", show: "", wantPkg: "ovmf", wantErrContains: "dpkg-query --show"},
		{name: "garbage", search: "nothing useful\n", wantErrContains: "no package"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFakeHost(t)
			code := f.write("OVMF/OVMF_CODE.fd", "code")
			f.write("OVMF/OVMF_VARS.fd", "vars")
			if tt.search != "" {
				f.dpkg["--search "+code] = strings.ReplaceAll(tt.search, "{code}", code)
			}
			if tt.show != "" {
				f.dpkg["--show "+tt.wantPkg] = tt.show
			}
			fw := New(f.config()).Report(context.Background()).Firmware
			if fw.Sha256 != sha("code") {
				t.Errorf("sha256 = %q", fw.Sha256)
			}
			if fw.Package != tt.wantPkg || fw.Version != tt.wantVer {
				t.Errorf("package/version = %q/%q, want %q/%q", fw.Package, fw.Version, tt.wantPkg, tt.wantVer)
			}
			if tt.wantNoErrorMessage && fw.Error != "" {
				t.Errorf("error = %q", fw.Error)
			}
			if !strings.Contains(fw.Error, tt.wantErrContains) {
				t.Errorf("error = %q, want it to contain %q", fw.Error, tt.wantErrContains)
			}
		})
	}
}

func TestFirmwareHashCache(t *testing.T) {
	f := newFakeHost(t)
	code := f.write("OVMF/OVMF_CODE.fd", "one")
	f.write("OVMF/OVMF_VARS.fd", "vars")
	p := New(f.config())
	if got := p.Report(context.Background()).Firmware.Sha256; got != sha("one") {
		t.Fatalf("sha256 = %q", got)
	}

	// Same size and mtime: the cached digest is served, not re-read.
	st, _ := os.Stat(code)
	if err := os.WriteFile(code, []byte("two"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(code, st.ModTime(), st.ModTime()); err != nil {
		t.Fatal(err)
	}
	if got := p.Report(context.Background()).Firmware.Sha256; got != sha("one") {
		t.Errorf("after an unnoticeable change: sha256 = %q, want the cached one", got)
	}

	// A new mtime invalidates it.
	later := st.ModTime().Add(time.Minute)
	if err := os.Chtimes(code, later, later); err != nil {
		t.Fatal(err)
	}
	if got := p.Report(context.Background()).Firmware.Sha256; got != sha("two") {
		t.Errorf("after touch: sha256 = %q, want sha256(two)", got)
	}
}
