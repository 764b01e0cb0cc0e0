package main

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"time"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/pkg/cli"
	"github.com/giantswarm/vm-manager/pkg/logging"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/catalog"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imageimport"
)

// imageImportCommand imports into the image directory without a running
// hypervisor, as pull and measure do: the policy it writes is handed to
// attestation when the hypervisor next starts. Through a running service,
// ImportImage (gRPC, REST, MCP) hands it over at once.
func imageImportCommand(ia *imageArgs, stdout io.Writer) cli.Command {
	return catalogCommand(ia, "image import", "<oci-ref>: import an OCI image (registry/repository:tag, @sha256:…, or oci-layout:<dir>[:<tag>]) into the image directory as a dm-verity root booted by a kernel image",
		"image directory to import into (default <state-dir>/images)", func(fs *cli.FlagSet) func(ctx context.Context, ref, dir string) error {
			hostConfig := hostFlags(fs)
			id := fs.String("id", "", "", "catalog id (default: the repository's last path element)")
			version := fs.String("version", "", "", "catalog version (default: the tag, else sha256-<12 hex>)")
			boot := fs.String("boot-image", "VM_MANAGER_OCI_BOOT_IMAGE", imageimport.DefaultBootImage, "the kernel image that boots it")
			maxImage := fs.Int("max-image-bytes", "VM_MANAGER_MAX_IMAGE_BYTES", imageimport.DefaultMaxImageBytes, "largest image: compressed layers, and the root's file contents")
			storeQuota := fs.Int("image-store-bytes", "VM_MANAGER_IMAGE_STORE_BYTES", imageimport.DefaultStoreQuota, "the roots of all imported OCI images together")
			plain := fs.Bool("plain-http", "VM_MANAGER_REGISTRY_PLAIN_HTTP", false, "talk HTTP, not HTTPS, to the registry (loopback registries always are)")
			logger := logging.Flags(fs, "warn", "hypervisor")
			return func(ctx context.Context, ref, dir string) error {
				log, err := logger()
				if err != nil {
					return err
				}
				cat, err := catalog.Load(dir, log)
				if err != nil {
					return err
				}
				drv, report, err := measuringDriver(ctx, hostConfig(), log)
				if err != nil {
					return err
				}
				im := imageimport.New(imageimport.Config{MaxImageBytes: int64(*maxImage), StoreQuota: int64(*storeQuota),
					BootImage: *boot, PlainHTTP: *plain, Firmware: report.GetFirmware()}, cat, drv, laterSync{}, log)
				start := time.Now()
				last := hypervisorv1.ImportPhase_IMPORT_PHASE_UNSPECIFIED
				res, err := im.Import(ctx, &hypervisorv1.ImportImageRequest{Source: ref, Id: *id, Version: *version},
					func(p *hypervisorv1.ImportImageResponse) error {
						if p.GetPhase() != last {
							last = p.GetPhase()
							fmt.Fprintf(stdout, "%s\n", phaseLine(p))
						}
						return nil
					})
				if err != nil {
					return err
				}
				img := res.GetImage()
				status := "imported"
				if res.GetUnchanged() {
					status = "unchanged (this manifest is already the image)"
				}
				fmt.Fprintf(stdout, "image: %s\nstatus: %s\nsource: %s\nmanifest: %s\nroot-hash: %s\nstored-bytes: %d\nboot-image: %s\ntook: %s\n",
					img.GetRef(), status, img.GetOci().GetReference(), img.GetOci().GetManifestDigest(), img.GetOci().GetRootHash(),
					img.GetOci().GetStoredBytes(), img.GetOci().GetBootImage(), time.Since(start).Round(100*time.Millisecond))
				return nil
			}
		})
}

func phaseLine(p *hypervisorv1.ImportImageResponse) string {
	switch p.GetPhase() {
	case hypervisorv1.ImportPhase_IMPORT_PHASE_RESOLVING:
		return "resolving the reference"
	case hypervisorv1.ImportPhase_IMPORT_PHASE_LAYERS:
		return fmt.Sprintf("reading layers (%d bytes)", p.GetBytesTotal())
	case hypervisorv1.ImportPhase_IMPORT_PHASE_ROOT:
		return "writing the erofs root and its dm-verity hash tree"
	case hypervisorv1.ImportPhase_IMPORT_PHASE_MEASURING:
		return "measuring the boot chain (one boot, golden PCRs)"
	}
	return cmp.Or(p.GetPhase().String(), "?")
}

// laterSync leaves the policy in the image directory: the hypervisor hands
// it to attestation at its next start.
type laterSync struct{}

func (laterSync) Sync(context.Context, string, []byte) error { return nil }
