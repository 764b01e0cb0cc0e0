package qemu

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"github.com/giantswarm/vm-manager/sdk/apierr"
)

const vmDir = "/var/lib/vmm/vms/0a1b2c3d"

func baseSpec(boot Boot) Spec {
	s := Spec{
		ID:          "0a1b2c3d",
		QEMUVersion: Version{7, 2, 22},
		Accel:       AccelKVM,
		CPUs:        2,
		MemoryMiB:   2048,
		ConsoleLog:  vmDir + "/console.log",
		QMPSocket:   vmDir + "/qmp.sock",
		OVMFCode:    "/usr/share/OVMF/OVMF_CODE_4M.fd",
		OVMFVars:    vmDir + "/ovmf_vars.fd",
		Boot:        boot,
		SwtpmSocket: vmDir + "/tpm/swtpm.sock",
	}
	switch boot {
	case BootInstall:
		s.UKI = "/img/flatcar_1.efi"
		s.Installer = "/img/flatcar_1.raw"
		s.Volume = "/vol/vm-0a1b2c3d.volume"
	case BootDisk:
		s.Volume = "/vol/vm-0a1b2c3d.volume"
	case BootKernel:
		s.Kernel = "/img/test_1.vmlinuz"
		s.Initrd = "/img/test_1.initrd"
		s.Cmdline = "console=ttyS0 panic=-1"
	}
	return s
}

func mustArgs(t *testing.T, s Spec) []string {
	t.Helper()
	a, err := s.Args()
	if err != nil {
		t.Fatalf("Args: %v", err)
	}
	return a
}

func TestArgsInstallFullOrder(t *testing.T) {
	s := baseSpec(BootInstall)
	s.NetdevSocket = "/var/lib/vmm/networks/default/qemu.sock"
	s.MAC = "52:54:00:AB:CD:EF"
	s.VsockCID = 1234
	s.Credentials = map[string]string{
		"vmm.notify_socket":        "vsock-stream:2:9999",
		"system.machine_id":        "0123456789abcdef0123456789abcdef",
		"ssh.authorized_keys.root": "ssh-ed25519 AAAA vm-manager@0a1b2c3d\n",
		"vm.install-target":        "/dev/disk/by-id/virtio-target",
	}
	want := []string{
		"-name", "guest=0a1b2c3d",
		"-machine", "q35", "-accel", "kvm", "-cpu", "host", "-smp", "2", "-m", "2048M",
		"-nodefaults", "-display", "none",
		"-chardev", "file,id=serial0,path=" + vmDir + "/console.log,append=on", "-serial", "chardev:serial0",
		"-qmp", "unix:" + vmDir + "/qmp.sock,server=on,wait=off",
		"-drive", "if=pflash,format=raw,unit=0,readonly=on,file=/usr/share/OVMF/OVMF_CODE_4M.fd",
		"-drive", "if=pflash,format=raw,unit=1,file=" + vmDir + "/ovmf_vars.fd",
		"-kernel", "/img/flatcar_1.efi",
		"-drive", "if=none,id=installer,format=raw,file=/img/flatcar_1.raw,readonly=on",
		"-device", "virtio-blk-pci,drive=installer,serial=installer",
		"-drive", "if=none,id=target,format=raw,file=/vol/vm-0a1b2c3d.volume,discard=unmap",
		"-device", "virtio-blk-pci,drive=target,serial=target",
		"-netdev", "stream,id=net0,server=on,addr.type=unix,addr.path=/var/lib/vmm/networks/default/qemu.sock",
		"-device", "virtio-net-pci,netdev=net0,mac=52:54:00:ab:cd:ef,romfile=",
		"-device", "vhost-vsock-pci,id=vsock0,guest-cid=1234",
		"-device", "virtio-rng-pci",
		"-chardev", "socket,id=chrtpm,path=" + vmDir + "/tpm/swtpm.sock",
		"-tpmdev", "emulator,id=tpm0,chardev=chrtpm",
		"-device", "tpm-crb,tpmdev=tpm0",
		"-smbios", "type=1,manufacturer=GiantSwarm,product=vm-manager,serial=0a1b2c3d",
		"-smbios", "type=11,value=io.systemd.credential.binary:ssh.authorized_keys.root=c3NoLWVkMjU1MTkgQUFBQSB2bS1tYW5hZ2VyQDBhMWIyYzNkCg==",
		"-smbios", "type=11,value=io.systemd.credential:system.machine_id=0123456789abcdef0123456789abcdef",
		"-smbios", "type=11,value=io.systemd.credential:vm.install-target=/dev/disk/by-id/virtio-target",
		"-smbios", "type=11,value=io.systemd.credential:vmm.notify_socket=vsock-stream:2:9999",
		"-no-reboot", // and no -action: the installer's end ends the phase
	}
	if got := mustArgs(t, s); !slices.Equal(got, want) {
		t.Errorf("argv mismatch\n got: %q\nwant: %q", got, want)
	}
}

func TestArgsDiskBootFirstBootAndSerialNotify(t *testing.T) {
	s := baseSpec(BootDisk)
	s.Accel = AccelTCG
	s.FirstBoot = true
	s.NotifySocket = vmDir + "/notify.sock"
	got := strings.Join(mustArgs(t, s), " ")
	for _, want := range []string{
		"-accel tcg -cpu max",
		"-device virtio-blk-pci,drive=target,serial=target,bootindex=0",
		"-device virtio-serial-pci -chardev socket,id=notify,path=" + vmDir + "/notify.sock,server=on,wait=off -device virtserialport,chardev=notify,name=org.giantswarm.vmm.notify -device virtio-rng-pci",
		"-smbios type=11,value=io.systemd.stub.kernel-cmdline-extra=ignition.firstboot",
		"-device tpm-crb,tpmdev=tpm0 -action reboot=shutdown -smbios type=1,",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("argv lacks %q:\n%s", want, got)
		}
	}
	for _, absent := range []string{"-kernel", "installer", "-no-reboot", "vhost-vsock", "-netdev"} {
		if strings.Contains(got, absent) {
			t.Errorf("argv has %q:\n%s", absent, got)
		}
	}
	if !strings.HasSuffix(got, "ignition.firstboot") {
		t.Errorf("first-boot credential is not last:\n%s", got)
	}
}

func TestArgsCPUOverride(t *testing.T) {
	s := baseSpec(BootDisk)
	s.CPU = "host,-arch-capabilities"
	a := mustArgs(t, s)
	if got := a[slices.Index(a, "-cpu")+1]; got != "host,-arch-capabilities" {
		t.Errorf("-cpu %s", got)
	}
	s.CPU = "host\n"
	if _, err := s.Args(); err == nil {
		t.Error("accepted a cpu model with a newline")
	}
}

func TestArgsKernel(t *testing.T) {
	s := baseSpec(BootKernel)
	s.SwtpmSocket = ""
	got := mustArgs(t, s)
	joined := strings.Join(got, " ")
	if !strings.Contains(joined, "-kernel /img/test_1.vmlinuz -initrd /img/test_1.initrd -append console=ttyS0 panic=-1 -device virtio-rng-pci") ||
		!strings.Contains(joined, "-action reboot=shutdown") {
		t.Errorf("kernel boot argv: %s", joined)
	}
	for _, absent := range []string{"-drive if=none", "tpm", "-no-reboot"} {
		if strings.Contains(joined, absent) {
			t.Errorf("argv has %q: %s", absent, joined)
		}
	}
	i := slices.Index(got, "-append")
	if got[i+1] != "console=ttyS0 panic=-1" {
		t.Errorf("-append value %q is not one argument", got[i+1])
	}

	s.Cmdline = ""
	s.Volume = "/vol/data.volume"
	joined = strings.Join(mustArgs(t, s), " ")
	if strings.Contains(joined, "-append") {
		t.Errorf("empty command line still appended: %s", joined)
	}
	if !strings.Contains(joined, "-device virtio-blk-pci,drive=target,serial=target -device") {
		t.Errorf("volume of a kernel boot must be attached without bootindex: %s", joined)
	}
}

func TestArgsFirmwareOnly(t *testing.T) {
	s := baseSpec(BootFirmware)
	joined := strings.Join(mustArgs(t, s), " ")
	for _, absent := range []string{"-kernel", "-drive if=none", "-netdev", "-no-reboot"} {
		if strings.Contains(joined, absent) {
			t.Errorf("firmware-only argv has %q: %s", absent, joined)
		}
	}
}

// QEMU listens on the netdev socket whatever its version: the hypervisor dials.
func TestArgsNetdevListensOnEveryVersion(t *testing.T) {
	for _, v := range []Version{{}, {7, 2, 22}, {8, 0, 0}, {9, 1, 3}, {9, 2, 0}, {10, 1, 0}} {
		s := baseSpec(BootDisk)
		s.QEMUVersion = v
		s.NetdevSocket = "/run/net.sock"
		s.MAC = "52-54-00-00-00-01"
		a := mustArgs(t, s)
		nd := a[slices.Index(a, "-netdev")+1]
		if want := "stream,id=net0,server=on,addr.type=unix,addr.path=/run/net.sock"; nd != want {
			t.Errorf("QEMU %v: -netdev %s, want %s", v, nd, want)
		}
	}
}

func TestArgsEscapesCommas(t *testing.T) {
	s := baseSpec(BootInstall)
	s.ID = "a,b"
	s.ConsoleLog = "/d,x/console.log"
	s.QMPSocket = "/d,x/qmp.sock"
	s.OVMFVars = "/d,x/vars.fd"
	s.UKI = "/d,x/uki.efi"
	s.Installer = "/d,x/img.raw"
	s.Volume = "/d,x/vol"
	s.SwtpmSocket = "/d,x/swtpm.sock"
	s.NetdevSocket, s.MAC = "/d,x/net.sock", "52:54:00:00:00:01"
	s.Credentials = map[string]string{"firstboot.hostname": "x,y"}
	got := strings.Join(mustArgs(t, s), " ")
	for _, want := range []string{
		"guest=a,,b ",
		"-chardev file,id=serial0,path=/d,,x/console.log,append=on -serial chardev:serial0 ",
		"unix:/d,,x/qmp.sock,server=on",
		"unit=1,file=/d,,x/vars.fd ",
		"-kernel /d,x/uki.efi ", // verbatim too
		"file=/d,,x/img.raw,readonly=on",
		"file=/d,,x/vol,discard=unmap",
		"path=/d,,x/swtpm.sock ",
		"addr.path=/d,,x/net.sock ",
		"serial=a,,b ",
		"io.systemd.credential:firstboot.hostname=x,,y",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("argv lacks %q:\n%s", want, got)
		}
	}
}

func TestCredentialEncoding(t *testing.T) {
	for _, tc := range []struct{ value, want string }{
		{"plain value", "io.systemd.credential:c=plain value"},
		{"", "io.systemd.credential:c="},
		{"ünïcode", "io.systemd.credential:c=ünïcode"},
		{"two\nlines", "io.systemd.credential.binary:c=dHdvCmxpbmVz"},
		{"tab\there", "io.systemd.credential.binary:c=dGFiCWhlcmU="},
		{"\xff\xfe", "io.systemd.credential.binary:c=//4="},
	} {
		if got := credential("c", tc.value); got != tc.want {
			t.Errorf("credential(%q) = %q, want %q", tc.value, got, tc.want)
		}
	}
}

func TestValidation(t *testing.T) {
	long := "/" + strings.Repeat("s", MaxSocketPath) // 108 bytes
	ok107 := "/" + strings.Repeat("s", MaxSocketPath-1)
	for _, tc := range []struct {
		name   string
		mutate func(*Spec)
		ok     bool
	}{
		{"valid", func(*Spec) {}, true},
		{"no id", func(s *Spec) { s.ID = "" }, false},
		{"id with newline", func(s *Spec) { s.ID = "a\nb" }, false},
		{"accel", func(s *Spec) { s.Accel = "hvf" }, false},
		{"cpus 0", func(s *Spec) { s.CPUs = 0 }, false},
		{"cpus 256", func(s *Spec) { s.CPUs = 256 }, true},
		{"cpus 257", func(s *Spec) { s.CPUs = 257 }, false},
		{"memory 255", func(s *Spec) { s.MemoryMiB = 255 }, false},
		{"memory 256", func(s *Spec) { s.MemoryMiB = 256 }, true},
		{"qmp 107 bytes", func(s *Spec) { s.QMPSocket = ok107 }, true},
		{"qmp 108 bytes", func(s *Spec) { s.QMPSocket = long }, false},
		{"notify 108 bytes", func(s *Spec) { s.NotifySocket = long }, false},
		{"swtpm 108 bytes", func(s *Spec) { s.SwtpmSocket = long }, false},
		{"netdev 108 bytes", func(s *Spec) { s.NetdevSocket, s.MAC = long, "52:54:00:00:00:01" }, false},
		{"relative path", func(s *Spec) { s.ConsoleLog = "console.log" }, false},
		{"no qmp", func(s *Spec) { s.QMPSocket = "" }, false},
		{"no console", func(s *Spec) { s.ConsoleLog = "" }, false},
		{"no ovmf code", func(s *Spec) { s.OVMFCode = "" }, false},
		{"no ovmf vars", func(s *Spec) { s.OVMFVars = "" }, false},
		{"no uki", func(s *Spec) { s.UKI = "" }, false},
		{"no installer", func(s *Spec) { s.Installer = "" }, false},
		{"no volume", func(s *Spec) { s.Volume = "" }, false},
		{"kernel on install", func(s *Spec) { s.Kernel = "/k" }, false},
		{"no boot mode", func(s *Spec) { s.Boot = 0 }, false},
		{"cid 2", func(s *Spec) { s.VsockCID = 2 }, false},
		{"cid 3", func(s *Spec) { s.VsockCID = 3 }, true},
		{"cid max", func(s *Spec) { s.VsockCID = 0xFFFFFFFE }, true},
		{"cid any", func(s *Spec) { s.VsockCID = 0xFFFFFFFF }, false},
		{"cid and notify", func(s *Spec) { s.VsockCID, s.NotifySocket = 3, "/n.sock" }, false},
		{"serial 20", func(s *Spec) { s.TargetSerial = strings.Repeat("a", 20) }, true},
		{"serial 21", func(s *Spec) { s.TargetSerial = strings.Repeat("a", 21) }, false},
		{"serial chars", func(s *Spec) { s.InstallerSerial = "in,st" }, false},
		{"serial ok chars", func(s *Spec) { s.InstallerSerial = "A-z_0.9" }, true},
		{"same serials", func(s *Spec) { s.TargetSerial = DefaultInstallerSerial }, false},
		{"mac 64-bit", func(s *Spec) { s.NetdevSocket, s.MAC = "/n.sock", "02:00:5e:10:00:00:00:01" }, false},
		{"mac garbage", func(s *Spec) { s.NetdevSocket, s.MAC = "/n.sock", "52:54:00:zz:00:01" }, false},
		{"mac missing", func(s *Spec) { s.NetdevSocket = "/n.sock" }, false},
		{"mac without netdev", func(s *Spec) { s.MAC = "52:54:00:00:00:01" }, false},
		{"credential slash", func(s *Spec) { s.Credentials = map[string]string{"a/b": "x"} }, false},
		{"credential colon", func(s *Spec) { s.Credentials = map[string]string{"a:b": "x"} }, false},
		{"credential equals", func(s *Spec) { s.Credentials = map[string]string{"a=b": "x"} }, false},
		{"credential empty", func(s *Spec) { s.Credentials = map[string]string{"": "x"} }, false},
		{"credential 255", func(s *Spec) { s.Credentials = map[string]string{strings.Repeat("c", 255): "x"} }, true},
		{"credential 256", func(s *Spec) { s.Credentials = map[string]string{strings.Repeat("c", 256): "x"} }, false},
		{"first boot on install", func(s *Spec) { s.FirstBoot = true }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := baseSpec(BootInstall)
			tc.mutate(&s)
			_, err := s.Args()
			if tc.ok {
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("accepted")
			}
			if apierr.CodeOf(err) != apierr.InvalidRequest || !errors.Is(err, apierr.ErrInvalid) {
				t.Errorf("error %v has code %q, want %q", err, apierr.CodeOf(err), apierr.InvalidRequest)
			}
			if s.Validate() == nil {
				t.Error("Validate accepted what Args rejected")
			}
		})
	}
}

func TestParseVersion(t *testing.T) {
	for _, tc := range []struct {
		out  string
		want Version
		ok   bool
	}{
		{"QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\nCopyright (c) 2003-2022 Fabrice Bellard\n", Version{7, 2, 22}, true},
		{"QEMU emulator version 9.2.0\n", Version{9, 2, 0}, true},
		{"QEMU emulator version 10.1\n", Version{10, 1, 0}, true},
		{"something else\n", Version{}, false},
	} {
		v, err := ParseVersion(tc.out)
		if (err == nil) != tc.ok || v != tc.want {
			t.Errorf("ParseVersion(%q) = %v, %v; want %v ok=%v", tc.out, v, err, tc.want, tc.ok)
		}
	}
	if !(Version{9, 2, 0}).AtLeast(9, 2) || (Version{9, 1, 9}).AtLeast(9, 2) || !(Version{10, 0, 0}).AtLeast(9, 2) {
		t.Error("AtLeast")
	}
}

// An OCI image's root and hash tree are attached read-only by serial; a
// serial another disk has is refused.
func TestReadOnlyDisks(t *testing.T) {
	s := baseSpec(BootKernel)
	s.ReadOnlyDisks = []Disk{{Path: "/img/a.erofs", Serial: "oci-root"}, {Path: "/img/a.verity", Serial: "oci-verity"}}
	args, err := s.Args()
	if err != nil {
		t.Fatal(err)
	}
	line := strings.Join(args, " ")
	for _, want := range []string{
		"-drive if=none,id=ro0,format=raw,file=/img/a.erofs,readonly=on -device virtio-blk-pci,drive=ro0,serial=oci-root",
		"-drive if=none,id=ro1,format=raw,file=/img/a.verity,readonly=on -device virtio-blk-pci,drive=ro1,serial=oci-verity",
	} {
		if !strings.Contains(line, want) {
			t.Errorf("argv lacks %q:\n%s", want, line)
		}
	}
	s.ReadOnlyDisks[1].Serial = DefaultTargetSerial
	if err := s.Validate(); err == nil {
		t.Error("a read-only disk with the target's serial was accepted")
	}
	s.ReadOnlyDisks[1] = Disk{Path: "relative", Serial: "x"}
	if err := s.Validate(); err == nil {
		t.Error("a relative read-only disk path was accepted")
	}
}

// A VM's disk is raw or a qcow2 overlay, by name; a saved argv is made to
// name the disk's active layer, and nothing else in it changes.
func TestTargetDrive(t *testing.T) {
	if got := VolumeFormat("/s/vms/x/disk.raw"); got != "raw" {
		t.Errorf("raw disk: %s", got)
	}
	if got := VolumeFormat("/s/vms/x/disk-0a1b2c3d4e5f.qcow2"); got != "qcow2" {
		t.Errorf("overlay: %s", got)
	}
	argv := []string{"-name", "guest=x", "-drive", "if=pflash,format=raw,unit=1,file=/s/vars.fd",
		"-drive", TargetDrive("/s/vms/x/disk.raw"), "-device", "virtio-blk-pci,drive=target,serial=vm-target",
		"-drive", "if=none,id=ro0,format=raw,file=/img/root.erofs,readonly=on"}
	got := ReplaceTargetDrive(argv, "/s/vms/x/disk-0a1b.qcow2")
	want := slices.Clone(argv)
	want[5] = "if=none,id=target,format=qcow2,file=/s/vms/x/disk-0a1b.qcow2,discard=unmap"
	if !slices.Equal(got, want) {
		t.Errorf("ReplaceTargetDrive:\n got %q\nwant %q", got, want)
	}
	if argv[5] != TargetDrive("/s/vms/x/disk.raw") {
		t.Error("ReplaceTargetDrive changed its argument")
	}
}
