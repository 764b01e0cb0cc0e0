// Package version carries the guest version, stamped by hack/guest-image.sh with
// -ldflags "-X github.com/giantswarm/vm-manager/guest/internal/version.Version=<v>".
package version

// Version is the guest image version.
var Version = "dev"
