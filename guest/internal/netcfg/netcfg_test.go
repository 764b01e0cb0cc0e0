package netcfg

import (
	"errors"
	"net"
	"testing"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
)

func TestPickEthernet(t *testing.T) {
	mac := net.HardwareAddr{0x52, 0x54, 0, 0x12, 0x34, 0x56}
	ifs := []net.Interface{
		{Index: 4, Name: "eth1", HardwareAddr: mac},
		{Index: 1, Name: "lo", Flags: net.FlagLoopback, HardwareAddr: make(net.HardwareAddr, 6)},
		{Index: 2, Name: "sit0", HardwareAddr: mac},
		{Index: 3, Name: "eth0", HardwareAddr: mac},
	}
	ifc, err := pickEthernet(ifs)
	if err != nil || ifc.Name != "eth0" {
		t.Fatalf("%v %v", ifc, err)
	}
	if _, err := pickEthernet([]net.Interface{{Index: 1, Name: "lo", Flags: net.FlagLoopback}}); !errors.Is(err, ErrNoInterface) {
		t.Fatalf("only lo: %v", err)
	}
}

func ack(t *testing.T, mods ...dhcpv4.Modifier) *dhcpv4.DHCPv4 {
	m, err := dhcpv4.New(append([]dhcpv4.Modifier{dhcpv4.WithMessageType(dhcpv4.MessageTypeAck)}, mods...)...)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestLeaseFromACK(t *testing.T) {
	l, err := leaseFromACK("eth0", ack(t,
		dhcpv4.WithYourIP(net.IPv4(192, 168, 127, 2)),
		dhcpv4.WithNetmask(net.CIDRMask(24, 32)),
		dhcpv4.WithRouter(net.IPv4(192, 168, 127, 1)),
		dhcpv4.WithDNS(net.IPv4(192, 168, 127, 1)),
		dhcpv4.WithLeaseTime(3600),
	))
	if err != nil {
		t.Fatal(err)
	}
	if got := l.String(); got != "192.168.127.2/24 via 192.168.127.1" {
		t.Errorf("%q", got)
	}
	if l.Duration != time.Hour || len(l.DNS) != 1 || l.Addr.Contains(IMDSAddr) {
		t.Errorf("%+v", l)
	}

	// No mask option: classful; no router: the IMDS needs its own route.
	l, err = leaseFromACK("eth0", ack(t, dhcpv4.WithYourIP(net.IPv4(10, 0, 2, 15))))
	if err != nil || l.String() != "10.0.2.15/8 via no gateway" || l.Gateway != nil {
		t.Errorf("%v %v", l, err)
	}
	// QEMU user networking with net=169.254.169.0/24: the IMDS is on-link.
	l, _ = leaseFromACK("eth0", ack(t, dhcpv4.WithYourIP(net.IPv4(169, 254, 169, 15)), dhcpv4.WithNetmask(net.CIDRMask(24, 32))))
	if !l.Addr.Contains(IMDSAddr) {
		t.Errorf("%v", l)
	}
	if _, err := leaseFromACK("eth0", ack(t)); err == nil {
		t.Error("ACK without an address accepted")
	}
}
