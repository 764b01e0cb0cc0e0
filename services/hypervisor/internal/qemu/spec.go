// Package qemu builds the QEMU command line of a VM and talks QMP to it.
package qemu

import (
	"encoding/base64"
	"maps"
	"net"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

// Accelerators.
const (
	AccelKVM = "kvm"
	AccelTCG = "tcg"
)

// Boot says what the VM boots and so which of Spec's boot fields apply.
type Boot int

const (
	// BootKernel is a direct-kernel image: -kernel, -initrd, -append.
	BootKernel Boot = iota + 1
	// BootInstall is a UKI image's installer phase: the UKI as -kernel, the
	// image's raw disk read-only, the target volume, -no-reboot.
	BootInstall
	// BootDisk is a UKI image's installed boot from the target volume.
	BootDisk
	// BootFirmware runs the firmware alone (tests, firmware measurements).
	BootFirmware
)

func (b Boot) String() string {
	switch b {
	case BootKernel:
		return "kernel"
	case BootInstall:
		return "install"
	case BootDisk:
		return "disk"
	case BootFirmware:
		return "firmware"
	}
	return "Boot(" + strconv.Itoa(int(b)) + ")"
}

// Defaults and limits of a Spec.
const (
	DefaultInstallerSerial = "installer"
	DefaultTargetSerial    = "target"
	// NotifyPortName is the virtio-serial port the guest writes READY=1 to.
	NotifyPortName = "org.giantswarm.vmm.notify"
	// FirstBootCmdlineExtra is appended to the UKI's command line on the first
	// installed boot (systemd-stub reads it from this SMBIOS credential).
	FirstBootCmdlineExtra = "io.systemd.stub.kernel-cmdline-extra=" + FirstBootExtra
	// FirstBootExtra is the command line systemd-stub appends (and measures
	// into PCR 12) on a first installed boot.
	FirstBootExtra = "ignition.firstboot"

	MaxSocketPath     = 107 // sun_path is 108 bytes including the NUL
	MinCID            = 3
	MaxCID            = 0xFFFFFFFE
	MinCPUs, MaxCPUs  = 1, 256
	MinMemoryMiB      = 256
	MaxCredentialName = 255
)

// Spec is one QEMU run of a VM. All paths must be absolute.
type Spec struct {
	ID string
	// QEMUVersion is the version of the QEMU binary (ProbeVersion), for
	// option spellings that change between releases; none differ today. The
	// zero value means "old": the 7.2 spellings.
	QEMUVersion Version
	Accel       string // AccelKVM or AccelTCG
	// CPU overrides the -cpu model (default: "host" under KVM, "max" under
	// TCG). On nested KVM hosts QEMU 7.2 aborts with -cpu host ("failed to
	// set MSR 0x10a"); "host,-arch-capabilities" works there.
	CPU       string
	CPUs      int
	MemoryMiB int

	ConsoleLog string // serial console output
	QMPSocket  string
	OVMFCode   string // read-only firmware
	OVMFVars   string // the VM's own copy of the variable store

	Boot Boot
	// BootInstall.
	UKI       string
	Installer string // the image's raw disk, attached read-only
	// The target disk: required for BootInstall and BootDisk, optional otherwise.
	Volume string
	// BootKernel. An empty Cmdline omits -append.
	Kernel, Initrd, Cmdline string
	// Disk serials (/dev/disk/by-id/virtio-<serial>); empty takes the defaults.
	InstallerSerial, TargetSerial string
	// ReadOnlyDisks are attached read-only after the target (an OCI image's
	// root and its verity hash device).
	ReadOnlyDisks []Disk

	// Network: attached only when NetdevSocket is set; MAC is then required.
	// QEMU listens on NetdevSocket and the network dials it.
	NetdevSocket string
	MAC          string

	// Readiness channel: a vsock CID (hosts with /dev/vhost-vsock) or a unix
	// socket QEMU listens on for a virtio-serial port; at most one.
	VsockCID     uint32
	NotifySocket string

	// SwtpmSocket is swtpm's control socket; empty runs without a TPM.
	SwtpmSocket string

	// Credentials go to systemd as SMBIOS type 11 strings.
	Credentials map[string]string
	// FirstBoot adds FirstBootCmdlineExtra (BootDisk only).
	FirstBoot bool
}

// Disk is a raw disk file and the serial the guest finds it by.
type Disk struct {
	Path, Serial string
}

var serialRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,20}$`)

func invalid(format string, args ...any) error {
	return apierr.Errorf(apierr.InvalidRequest, format, args...)
}

// Validate checks s without building the argv.
func (s Spec) Validate() error {
	_, err := s.Args()
	return err
}

// Args builds QEMU's argv (without the binary), in the contract's fixed order.
func (s Spec) Args() ([]string, error) {
	if err := s.validate(); err != nil {
		return nil, err
	}
	instSerial := orDefault(s.InstallerSerial, DefaultInstallerSerial)
	targetSerial := orDefault(s.TargetSerial, DefaultTargetSerial)

	cpu := s.CPU
	switch {
	case cpu != "":
	case s.Accel == AccelKVM:
		cpu = "host"
	default:
		cpu = "max"
	}
	a := []string{
		"-name", "guest=" + esc(s.ID),
		"-machine", "q35",
		"-accel", s.Accel,
		"-cpu", cpu,
		"-smp", strconv.Itoa(s.CPUs),
		"-m", strconv.Itoa(s.MemoryMiB) + "M",
		"-nodefaults",
		"-display", "none",
		// append=on: every write goes to the end of the file, so the
		// hypervisor can rotate it from outside while QEMU runs (and a new
		// run, the installed boot after the installer, keeps what was there).
		"-chardev", "file,id=serial0,path=" + esc(s.ConsoleLog) + ",append=on",
		"-serial", "chardev:serial0",
		"-qmp", "unix:" + esc(s.QMPSocket) + ",server=on,wait=off",
		"-drive", "if=pflash,format=raw,unit=0,readonly=on,file=" + esc(s.OVMFCode),
		"-drive", "if=pflash,format=raw,unit=1,file=" + esc(s.OVMFVars),
	}
	switch s.Boot {
	case BootInstall:
		// -kernel, -initrd and -append take their value verbatim.
		a = append(a,
			"-kernel", s.UKI,
			"-drive", "if=none,id=installer,format=raw,file="+esc(s.Installer)+",readonly=on",
			"-device", "virtio-blk-pci,drive=installer,serial="+instSerial,
		)
	case BootKernel:
		a = append(a, "-kernel", s.Kernel, "-initrd", s.Initrd)
		if s.Cmdline != "" {
			a = append(a, "-append", s.Cmdline)
		}
	}
	if s.Volume != "" {
		dev := "virtio-blk-pci,drive=" + TargetDriveID + ",serial=" + targetSerial
		if s.Boot == BootDisk {
			dev += ",bootindex=0"
		}
		a = append(a, "-drive", TargetDrive(s.Volume), "-device", dev)
	}
	for i, d := range s.ReadOnlyDisks {
		id := "ro" + strconv.Itoa(i)
		a = append(a,
			"-drive", "if=none,id="+id+",format=raw,file="+esc(d.Path)+",readonly=on",
			"-device", "virtio-blk-pci,drive="+id+",serial="+d.Serial,
		)
	}
	if s.NetdevSocket != "" {
		mac, _ := net.ParseMAC(s.MAC)
		a = append(a,
			"-netdev", s.netdev(),
			// romfile= drops the iPXE option ROM: nothing here boots from the network.
			"-device", "virtio-net-pci,netdev=net0,mac="+mac.String()+",romfile=",
		)
	}
	switch {
	case s.VsockCID != 0:
		a = append(a, "-device", "vhost-vsock-pci,id=vsock0,guest-cid="+strconv.FormatUint(uint64(s.VsockCID), 10))
	case s.NotifySocket != "":
		// QEMU listens so that a restarted hypervisor can dial it again.
		a = append(a,
			"-device", "virtio-serial-pci",
			"-chardev", "socket,id=notify,path="+esc(s.NotifySocket)+",server=on,wait=off",
			"-device", "virtserialport,chardev=notify,name="+NotifyPortName,
		)
	}
	// Without an entropy device the guest's first getrandom() blocks ~1 s.
	a = append(a, "-device", "virtio-rng-pci")
	if s.SwtpmSocket != "" {
		a = append(a,
			"-chardev", "socket,id=chrtpm,path="+esc(s.SwtpmSocket),
			"-tpmdev", "emulator,id=tpm0,chardev=chrtpm",
			"-device", "tpm-crb,tpmdev=tpm0",
		)
	}
	if s.Boot != BootInstall {
		// A reset inside the guest ends QEMU (SHUTDOWN reason guest-reset),
		// so the hypervisor starts and registers each boot itself: a new
		// boot never inherits the previous one's attestation. (The
		// installer's -no-reboot is the same, and ends the phase.)
		a = append(a, "-action", "reboot=shutdown")
	}
	a = append(a, "-smbios", "type=1,manufacturer=GiantSwarm,product=vm-manager,serial="+esc(s.ID))
	for _, name := range slices.Sorted(maps.Keys(s.Credentials)) {
		a = append(a, "-smbios", "type=11,value="+esc(credential(name, s.Credentials[name])))
	}
	if s.FirstBoot {
		a = append(a, "-smbios", "type=11,value="+FirstBootCmdlineExtra)
	}
	if s.Boot == BootInstall {
		a = append(a, "-no-reboot")
	}
	return a, nil
}

// netdev is the stream backend. QEMU listens and the hypervisor dials (and
// redials after a restart of its own): QEMU 7.2's client mode cannot
// reconnect, and a socket per VM tells the network which VM is talking.
func (s Spec) netdev() string {
	return "stream,id=net0,server=on,addr.type=unix,addr.path=" + esc(s.NetdevSocket)
}

func credential(name, value string) string {
	if singleLinePrintable(value) {
		return "io.systemd.credential:" + name + "=" + value
	}
	return "io.systemd.credential.binary:" + name + "=" + base64.StdEncoding.EncodeToString([]byte(value))
}

func singleLinePrintable(v string) bool {
	for _, r := range v {
		if r == utf8.RuneError || !unicode.IsPrint(r) {
			return false
		}
	}
	return true
}

func (s Spec) validate() error {
	if s.ID == "" {
		return invalid("vm id is required")
	}
	for _, r := range s.ID {
		if !unicode.IsPrint(r) || r == ' ' {
			return invalid("vm id %q has a character QEMU cannot take", s.ID)
		}
	}
	switch s.Accel {
	case AccelKVM, AccelTCG:
	default:
		return invalid("accelerator %q: want %q or %q", s.Accel, AccelKVM, AccelTCG)
	}
	for _, r := range s.CPU {
		if !unicode.IsPrint(r) || r == ' ' {
			return invalid("cpu model %q has a character QEMU cannot take", s.CPU)
		}
	}
	if s.CPUs < MinCPUs || s.CPUs > MaxCPUs {
		return invalid("cpus %d: want %d..%d", s.CPUs, MinCPUs, MaxCPUs)
	}
	if s.MemoryMiB < MinMemoryMiB {
		return invalid("memory %d MiB: want at least %d", s.MemoryMiB, MinMemoryMiB)
	}

	type path struct {
		name, value string
		required    bool
	}
	paths := []path{
		{"console log", s.ConsoleLog, true},
		{"OVMF code", s.OVMFCode, true},
		{"OVMF vars", s.OVMFVars, true},
		{"volume", s.Volume, s.Boot == BootInstall || s.Boot == BootDisk},
	}
	switch s.Boot {
	case BootInstall:
		paths = append(paths, path{"UKI", s.UKI, true}, path{"installer disk", s.Installer, true})
	case BootKernel:
		paths = append(paths, path{"kernel", s.Kernel, true}, path{"initrd", s.Initrd, true})
	case BootDisk, BootFirmware:
	default:
		return invalid("boot mode %v is not supported", s.Boot)
	}
	sockets := []path{
		{"QMP socket", s.QMPSocket, true},
		{"netdev socket", s.NetdevSocket, false},
		{"notify socket", s.NotifySocket, false},
		{"swtpm socket", s.SwtpmSocket, false},
	}
	serials := []string{orDefault(s.InstallerSerial, DefaultInstallerSerial), orDefault(s.TargetSerial, DefaultTargetSerial)}
	for _, d := range s.ReadOnlyDisks {
		paths = append(paths, path{"read-only disk " + d.Serial, d.Path, true})
		if !serialRE.MatchString(d.Serial) || slices.Contains(serials, d.Serial) {
			return invalid("read-only disk serial %q: want 1-20 characters of [A-Za-z0-9._-], unlike the other disks'", d.Serial)
		}
		serials = append(serials, d.Serial)
	}
	for _, p := range append(paths, sockets...) {
		if p.value == "" {
			if p.required {
				return invalid("%s path is required for boot mode %v", p.name, s.Boot)
			}
			continue
		}
		if !filepath.IsAbs(p.value) {
			return invalid("%s path %q is not absolute", p.name, p.value)
		}
		if strings.ContainsAny(p.value, "\x00\n") {
			return invalid("%s path %q contains a NUL or newline", p.name, p.value)
		}
	}
	for _, p := range sockets {
		if len(p.value) > MaxSocketPath {
			return invalid("%s path is %d bytes, longer than the %d a unix socket allows: %s", p.name, len(p.value), MaxSocketPath, p.value)
		}
	}
	if s.Boot != BootKernel && (s.Kernel != "" || s.Initrd != "" || s.Cmdline != "") {
		return invalid("kernel, initrd and command line apply to boot mode %v only", BootKernel)
	}
	if s.Boot != BootInstall && (s.UKI != "" || s.Installer != "") {
		return invalid("UKI and installer disk apply to boot mode %v only", BootInstall)
	}
	instSerial, targetSerial := orDefault(s.InstallerSerial, DefaultInstallerSerial), orDefault(s.TargetSerial, DefaultTargetSerial)
	for _, serial := range []string{instSerial, targetSerial} {
		if !serialRE.MatchString(serial) {
			return invalid("disk serial %q: want 1-20 characters of [A-Za-z0-9._-]", serial)
		}
	}
	if instSerial == targetSerial {
		return invalid("installer and target disks need different serials")
	}
	if s.NetdevSocket != "" || s.MAC != "" {
		if s.NetdevSocket == "" {
			return invalid("a MAC address needs a netdev socket")
		}
		mac, err := net.ParseMAC(s.MAC)
		if err != nil || len(mac) != 6 {
			return invalid("MAC address %q is not a 48-bit MAC", s.MAC)
		}
	}
	if s.VsockCID != 0 {
		if s.VsockCID < MinCID || s.VsockCID > MaxCID {
			return invalid("vsock CID %d: want %d..%d", s.VsockCID, MinCID, uint32(MaxCID))
		}
		if s.NotifySocket != "" {
			return invalid("set a vsock CID or a notify socket, not both")
		}
	}
	for name := range s.Credentials {
		if name == "" || name == "." || name == ".." || len(name) > MaxCredentialName || strings.ContainsAny(name, "/:=") {
			return invalid("credential name %q: want 1-%d characters without '/', ':' or '='", name, MaxCredentialName)
		}
		for _, r := range name {
			if !unicode.IsPrint(r) || r == ' ' {
				return invalid("credential name %q has a non-printable character", name)
			}
		}
	}
	if s.FirstBoot && s.Boot != BootDisk {
		return invalid("first-boot command line applies to boot mode %v only", BootDisk)
	}
	return nil
}

// esc doubles commas: QEMU's option parser reads ",," as a literal comma.
// TargetDrive is the -drive argument of the VM's disk at path: raw, or a
// qcow2 overlay (a fork's, or a forked parent's: driver/forkdisk.go) whose
// backing chain its header names.
func TargetDrive(path string) string {
	// Default AIO on purpose: aio=io_uring breaks where io_uring is disabled.
	return "if=none,id=" + TargetDriveID + ",format=" + VolumeFormat(path) + ",file=" + esc(path) + ",discard=unmap"
}

// TargetDriveID is the VM disk's drive id (QMP's device name for it).
const TargetDriveID = "target"

// VolumeFormat is the image format of a VM disk file, by its name.
func VolumeFormat(path string) string {
	if strings.HasSuffix(path, ".qcow2") {
		return "qcow2"
	}
	return "raw"
}

// ReplaceTargetDrive returns argv with the VM disk's -drive argument
// naming path: a QEMU's argv names the disk it started with, which a fork's
// snapshot has since made a backing file.
func ReplaceTargetDrive(argv []string, path string) []string {
	out := slices.Clone(argv)
	for i := 0; i+1 < len(out); i++ {
		if out[i] == "-drive" && strings.HasPrefix(out[i+1], "if=none,id="+TargetDriveID+",") {
			out[i+1] = TargetDrive(path)
		}
	}
	return out
}

func esc(v string) string { return strings.ReplaceAll(v, ",", ",,") }

func orDefault(v, def string) string {
	if v == "" {
		return def
	}
	return v
}
