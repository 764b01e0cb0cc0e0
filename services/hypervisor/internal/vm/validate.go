package vm

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"
	"unicode"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/sdk/defaults"
	"github.com/giantswarm/vm-manager/sdk/enumname"
)

// Limits of a VM's metadata: it lives in the VM record and is served key by
// key at /metadata/<key> (one path segment).
const (
	MaxMetadataEntries  = 128
	MaxMetadataKeyBytes = 128
	MaxMetadataBytes    = 256 << 10 // keys and values together
)

var (
	dnsLabel = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]*[a-z0-9])?$`)
	vmID     = regexp.MustCompile(`^[0-9a-f]{8}$`)
)

// request is a validated create request with its defaults filled in.
type request struct {
	name, hostname, kubernetesVersion string
	image                             *hypervisorv1.Image
	cpus, memoryMiB, diskGiB          int32
	userData                          string
	sshKeys                           []string
	metadata                          map[string]string
	requireAttestation                bool
	waitFor                           hypervisorv1.WaitFor
}

// ImageResolver finds images (the catalog).
type ImageResolver interface {
	Get(ref string) (*hypervisorv1.Image, error)
	Default() (*hypervisorv1.Image, error)
}

func validateLabel(field, v string) error {
	if len(v) > 63 || !dnsLabel.MatchString(v) {
		return apierr.Invalidf(field, "%s %q is not a DNS label (lower-case letters, digits and '-', at most 63 characters)", field, v)
	}
	return nil
}

// validate checks a create request once, at the edge of the domain; lim
// bounds its size.
func validate(req *hypervisorv1.CreateVirtualMachineRequest, images ImageResolver, lim Limits) (*request, error) {
	r := &request{name: req.GetName(), userData: req.GetUserData(), metadata: req.GetMetadata()}
	if err := validateLabel("name", r.name); err != nil {
		return nil, err
	}
	r.hostname = req.GetHostname()
	if r.hostname == "" {
		r.hostname = r.name
	}
	if err := validateLabel("hostname", r.hostname); err != nil {
		return nil, err
	}
	var err error
	if req.GetImage() == "" {
		r.image, err = images.Default()
		if apierr.CodeOf(err) == apierr.NotFound {
			return nil, apierr.Invalidf("image", "no image in the catalog: build one with make guest-image or check --image-dir")
		}
	} else {
		r.image, err = images.Get(req.GetImage())
		if apierr.CodeOf(err) == apierr.NotFound {
			return nil, apierr.Invalidf("image", "unknown image %q: list_images shows what exists", req.GetImage())
		}
	}
	if err != nil {
		return nil, err
	}
	offered := r.image.GetKubernetesVersions()
	switch kv := req.GetKubernetesVersion(); {
	case kv == "" && len(offered) > 0:
		r.kubernetesVersion = offered[0]
	case kv == "":
	case !slices.Contains(offered, kv):
		avail := "none"
		if len(offered) > 0 {
			avail = strings.Join(offered, ", ")
		}
		return nil, apierr.Invalidf("kubernetes_version", "image %s does not offer kubernetes %q; available: %s", r.image.GetRef(), kv, avail)
	default:
		r.kubernetesVersion = kv
	}
	// 0, like leaving a size out, means the default: the original's API
	// filled defaults over zero values, and its clients send 0 for "unset".
	r.cpus = orDefault(req.GetCpus(), defaults.CPUs)
	if r.cpus < 1 || r.cpus > 256 {
		return nil, apierr.Invalidf("cpus", "cpus %d is not within 1..256", r.cpus)
	}
	if lim.MaxCPUs > 0 && r.cpus > lim.MaxCPUs {
		return nil, apierr.Invalidf("cpus", "cpus %d is above this host's maximum of %d (--max-cpus)", r.cpus, lim.MaxCPUs)
	}
	r.memoryMiB = orDefault(req.GetMemoryMib(), defaults.MemoryMiB)
	if r.memoryMiB < 256 {
		return nil, apierr.Invalidf("memory_mib", "memory_mib %d is below 256", r.memoryMiB)
	}
	if lim.MaxMemoryMiB > 0 && r.memoryMiB > lim.MaxMemoryMiB {
		return nil, apierr.Invalidf("memory_mib", "memory_mib %d is above this host's maximum of %d (--max-memory-mib)", r.memoryMiB, lim.MaxMemoryMiB)
	}
	r.diskGiB = orDefault(req.GetDiskGib(), defaults.DiskGiB)
	if r.diskGiB < 1 || r.diskGiB > 4096 {
		return nil, apierr.Invalidf("disk_gib", "disk_gib %d is not within 1..4096", r.diskGiB)
	}
	if n := len(req.GetSshAuthorizedKeys()); n > MaxSSHKeys {
		return nil, apierr.Invalidf("ssh_authorized_keys", "at most %d ssh_authorized_keys, got %d", MaxSSHKeys, n)
	}
	for i, k := range req.GetSshAuthorizedKeys() {
		if k == "" || strings.ContainsAny(k, "\r\n") {
			return nil, apierr.Invalidf("ssh_authorized_keys", "ssh_authorized_keys[%d] must be one non-empty line", i)
		}
		if len(k) > MaxSSHKeyBytes {
			return nil, apierr.Invalidf("ssh_authorized_keys", "ssh_authorized_keys[%d] is %d bytes, at most %d", i, len(k), MaxSSHKeyBytes)
		}
	}
	r.sshKeys = req.GetSshAuthorizedKeys()
	if err := validateMetadata(r.metadata); err != nil {
		return nil, err
	}
	r.requireAttestation = true
	if req.RequireAttestation != nil {
		r.requireAttestation = req.GetRequireAttestation()
	}
	r.waitFor = req.GetWaitFor()
	if r.waitFor == hypervisorv1.WaitFor_WAIT_FOR_UNSPECIFIED { // REST's and MCP's "" too
		r.waitFor = hypervisorv1.WaitFor_WAIT_FOR_READY
	}
	return r, nil
}

// orDefault is v, or def for 0 (and for a size left out, which reads as 0).
// Negative values stay as they are, for the range checks to refuse.
func orDefault(v, def int32) int32 {
	if v == 0 {
		return def
	}
	return v
}

// validateMetadata checks the keys (one IMDS path segment each: non-empty,
// no '/', whitespace or control characters, not "." or "..") and the sizes.
func validateMetadata(md map[string]string) error {
	if len(md) > MaxMetadataEntries {
		return apierr.Invalidf("metadata", "at most %d metadata entries, got %d", MaxMetadataEntries, len(md))
	}
	total := 0
	for k, v := range md {
		if k == "" || k == "." || k == ".." || strings.ContainsFunc(k, func(r rune) bool { return r == '/' || unicode.IsSpace(r) || unicode.IsControl(r) }) {
			return apierr.Invalidf("metadata", "metadata key %q must be non-empty, not '.' or '..', without '/', whitespace or control characters", k)
		}
		if len(k) > MaxMetadataKeyBytes {
			return apierr.Invalidf("metadata", "metadata key %.32q… is %d bytes, at most %d", k, len(k), MaxMetadataKeyBytes)
		}
		total += len(k) + len(v)
	}
	if total > MaxMetadataBytes {
		return apierr.Invalidf("metadata", "metadata is %d bytes, at most %d", total, MaxMetadataBytes)
	}
	return nil
}

// waitName is the contract's name of a milestone.
func waitName(w hypervisorv1.WaitFor) string { return enumname.Of(w) }

func fmtDuration(d time.Duration) string { return fmt.Sprint(d.Round(time.Second)) }

// ValidID says whether id is a VM id: 8 hex characters.
func ValidID(id string) bool { return vmID.MatchString(id) }
