package main

import (
	"cmp"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/pkg/logging"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/catalog"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/driver"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/host"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/qemu"
)

// DefaultMeasuredPCRs are what a measuring boot records: the firmware PCRs
// attestation compares (docs/attestation.md), PCR 9 (the initrd the
// kernel's EFI stub loaded) and PCR 12 (systemd-stub's command-line
// overrides and credentials: none). Not PCR 0: OVMF's depends on the VM's
// memory size and vCPU count; the firmware is recorded by its identity
// (golden_firmware) instead.
const DefaultMeasuredPCRs = "2,3,4,6,7,9,12"

func imageMeasureCommand(ia *imageArgs, stdout io.Writer) cli.Command {
	return catalogCommand(ia, "image measure", "<ref>: boot a UKI image's disk once on this host's firmware and record its golden PCRs in <stem>.policy.json",
		"image directory (default <state-dir>/images)", func(fs *cli.FlagSet) func(ctx context.Context, ref, dir string) error {
			hostConfig := hostFlags(fs)
			pcrList := fs.String("pcrs", "VM_MANAGER_MEASURE_PCRS", DefaultMeasuredPCRs, "PCRs to record, comma-separated")
			timeout := fs.Duration("timeout", "VM_MANAGER_MEASURE_TIMEOUT", 3*time.Minute, "how long the boot may take to start the kernel")
			logger := logging.Flags(fs, "warn", "hypervisor")
			return func(ctx context.Context, ref, dir string) error {
				pcrs, err := parsePCRs(*pcrList)
				if err != nil {
					return err
				}
				log, err := logger()
				if err != nil {
					return err
				}
				cat, err := catalog.Load(dir, log)
				if err != nil {
					return err
				}
				img, err := cat.Get(ref)
				if err != nil {
					return err
				}
				hc := hostConfig()
				drv, report, err := measuringDriver(ctx, hc, log)
				if err != nil {
					return err
				}
				scratch, err := os.MkdirTemp("", "vmm-measure-")
				if err != nil {
					return err
				}
				defer os.RemoveAll(scratch)
				start := time.Now()
				values, err := drv.Measure(ctx, img, scratch, pcrs, *timeout)
				if err != nil {
					return fmt.Errorf("measuring boot of %s: %w", img.GetRef(), err)
				}
				path := filepath.Join(dir, img.GetRef()+".policy.json")
				base, _ := cat.PolicyDocument(img.GetRef())
				if err := writeGolden(path, img, base, values, report.GetFirmware()); err != nil {
					return err
				}
				fw := report.GetFirmware()
				fmt.Fprintf(stdout, "recorded golden sha256 PCRs %s of a measuring boot of %s on firmware %s %s (sha256 %s) into %s in %s\n",
					*pcrList, img.GetRef(), cmp.Or(fw.GetPackage(), "unpackaged"), fw.GetVersion(), fw.GetSha256(), path, time.Since(start).Round(100*time.Millisecond))
				return nil
			}
		})
}

func parsePCRs(s string) ([]uint, error) {
	var out []uint
	for f := range strings.SplitSeq(s, ",") {
		n, err := strconv.ParseUint(strings.TrimSpace(f), 10, 8)
		if err != nil || n > 23 {
			return nil, fmt.Errorf("--pcrs=%q: %q is not a PCR index 0..23", s, f)
		}
		if !slices.Contains(out, uint(n)) {
			out = append(out, uint(n))
		}
	}
	slices.Sort(out)
	return out, nil
}

// writeGolden sets golden.sha256 and golden_firmware in the image's own
// policy file, keeping every other field of the document that applied
// (base; the catalog's shared policy.json when the image had no file).
func writeGolden(path string, img *hypervisorv1.Image, base []byte, values map[uint32][]byte, fw *hypervisorv1.Firmware) error {
	doc := map[string]any{}
	if len(base) > 0 {
		if err := json.Unmarshal(base, &doc); err != nil {
			return fmt.Errorf("the policy of %s: %w", img.GetRef(), err)
		}
	}
	doc["image_id"], doc["image_version"] = img.GetId(), img.GetVersion()
	golden := map[string]string{}
	for idx, v := range values {
		golden[strconv.Itoa(int(idx))] = hex.EncodeToString(v)
	}
	doc["golden"] = map[string]any{"sha256": golden}
	delete(doc, "golden_firmware")
	if fw.GetSha256() != "" {
		m := map[string]string{"sha256": fw.GetSha256()}
		if fw.GetPackage() != "" {
			m["package"], m["version"] = fw.GetPackage(), fw.GetVersion()
		}
		doc["golden_firmware"] = m
	}
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return err
	}
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// measuringDriver is a driver for measuring boots on this host's QEMU, OVMF
// and swtpm, and the host report it was made from.
func measuringDriver(ctx context.Context, hc host.Config, log *slog.Logger) (*driver.Driver, *hypervisorv1.Host, error) {
	report := host.New(hc).Report(ctx)
	if report.GetOvmfCode() == "" || report.GetOvmfVars() == "" {
		return nil, nil, fmt.Errorf("no OVMF code and variable store found (--ovmf-code, --ovmf-vars)")
	}
	version, err := qemu.ProbeVersion(ctx, hc.QEMUBinary)
	if err != nil {
		return nil, nil, err
	}
	// TCG: the PCRs do not depend on the accelerator, and a measuring boot
	// needs no KVM probe.
	return driver.New(driver.Config{
		QEMUBinary: hc.QEMUBinary, SwtpmBinary: hc.SwtpmBinary, QEMUVersion: version,
		OVMFCode: report.GetOvmfCode(), OVMFVars: report.GetOvmfVars(),
		Accelerator: hypervisorv1.Accelerator_ACCELERATOR_TCG,
	}, log), report, nil
}
