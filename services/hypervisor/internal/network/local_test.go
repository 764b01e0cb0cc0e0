package network

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
)

// What a guest sends to the network's own addresses: the gateway answers
// DNS only, the host alias and free addresses nothing, each drop counted as
// local; the network's own connections to the guest (exec, forwards) and
// VM-to-VM traffic still work.
func TestLocalAddresses(t *testing.T) {
	n := startTest(t, Spec{Name: "local", CIDR: "10.86.0.0/24"}, nil, nil)
	a, aIP := guestOn(t, n, "a")
	ln, err := gonet.ListenTCP(a.stack, tcpip.FullAddress{NIC: 1, Addr: tcpip.AddrFrom4(aIP.As4()), Port: 22}, ipv4.ProtocolNumber)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_, _ = c.Write([]byte("SSH-2.0-x\r\n"))
			c.Close()
		}
	}()

	// The network dials the guest from the gateway: the guest's answers go
	// to the gateway's ports.
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	c, err := n.DialContextTCP(ctx, netip.AddrPortFrom(aIP, 22).String())
	if err != nil {
		t.Fatalf("the network's connection to the guest: %v", err)
	}
	buf := make([]byte, 8)
	if _, err := c.Read(buf); err != nil || string(buf) != "SSH-2.0-" {
		t.Fatalf("read %q: %v", buf, err)
	}
	c.Close()

	if c, err := a.dialTCP(netip.AddrPortFrom(n.plan.Gateway, 53), 5*time.Second); err != nil {
		t.Fatalf("DNS over TCP at the gateway: %v", err)
	} else {
		c.Close()
	}
	for _, dst := range []netip.AddrPort{
		netip.AddrPortFrom(n.plan.Gateway, 8080),
		netip.AddrPortFrom(n.plan.HostAlias, 22),
		netip.AddrPortFrom(netip.MustParseAddr("10.86.0.77"), 22),
		netip.AddrPortFrom(IMDSAddr, 8080),
	} {
		before := n.VMStats("a").EgressDropped["local"]
		if c, err := a.dialTCP(dst, 500*time.Millisecond); err == nil {
			c.Close()
			t.Errorf("%s answered", dst)
		}
		if after := n.VMStats("a").EgressDropped["local"]; after <= before {
			t.Errorf("%s: local drops %d -> %d", dst, before, after)
		}
	}
	if st := n.VMStats("a"); st.NATTCPFlows != 0 || st.EgressDropped["rule"] != 0 {
		t.Errorf("stats %+v", st)
	}
}
