package agent

import (
	"context"
	"encoding/hex"
	"net"
	"os"
	"strings"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/crypto/ssh"
	"golang.org/x/sys/unix"

	"github.com/giantswarm/vm-manager/guest/internal/attest"
	"github.com/giantswarm/vm-manager/guest/internal/imdsclient"
	"github.com/giantswarm/vm-manager/guest/internal/initsys"
	"github.com/giantswarm/vm-manager/guest/internal/netcfg"
	"github.com/giantswarm/vm-manager/guest/internal/sdnotify"
	"github.com/giantswarm/vm-manager/guest/internal/sshd"
)

// A fork of this VM is the parent's memory restored into another VM, with a
// vTPM of its own (fresh EK and AK, the parent's measurements replayed) and
// another port on the network, whose switch drops the parent's MAC and
// address there. The host tells the fork over the notify port, right after
// its first instruction runs, and vm-agent makes it a VM of its own:
//
//   - the kernel's random pool reseeded with the host's seed (the fork's
//     pool started as a copy of the parent's);
//   - the NIC's new MAC and the fork's address (the host's message names
//     it; the network, gateway and DNS are the parent's), or DHCP for it;
//   - a new SSH host key, kept in the fork's vTPM (the parent's was in the
//     parent's);
//   - the hostname and keys the IMDS serves the fork;
//   - a ready-stage quote signed by the fork's own AK;
//   - READY=1 again.
//
// The message's keys (sd_notify style, one per line).
const (
	ForkKey       = "VMM_FORK"
	ForkMACKey    = "VMM_FORK_MAC"
	ForkSeedKey   = "VMM_FORK_SEED"
	ForkParentKey = "VMM_FORK_PARENT"
	ForkIPKey     = "VMM_FORK_IP"
)

// hostListener reads what the host sends on the notify port.
type hostListener struct {
	con   *Console
	q     *queue
	sshd  func() *sshd.Server // nil server: none runs
	forks chan map[string]string
	lease atomic.Pointer[netcfg.Lease] // the network as this VM has it; nil: none
}

// receive runs until the port closes: forks are handled one at a time.
func (h *hostListener) receive(s *sdnotify.Serial) {
	go func() {
		for msg := range h.forks {
			h.fork(context.Background(), msg)
		}
	}()
	err := s.Receive(func(raw string) {
		msg := parseAssignments(raw)
		if msg[ForkKey] != "1" {
			h.con.Printf("host message ignored: %.80q", raw)
			return
		}
		select {
		case h.forks <- msg:
		default:
			h.con.Printf("fork message dropped: one is being handled")
		}
	}, 200*time.Millisecond)
	if err != nil {
		h.con.Printf("notify port: %v", err)
	}
}

func parseAssignments(raw string) map[string]string {
	out := map[string]string{}
	for _, line := range strings.Split(raw, "\n") {
		if k, v, ok := strings.Cut(line, "="); ok {
			out[k] = v
		}
	}
	return out
}

func (h *hostListener) fork(ctx context.Context, msg map[string]string) {
	start := time.Now()
	h.con.Printf("fork of %s: becoming a VM of its own", msg[ForkParentKey])
	h.q.Send("STATUS=forked: reidentifying")
	if seed, err := hex.DecodeString(msg[ForkSeedKey]); err != nil || len(seed) < 32 {
		h.con.Printf("warning: fork: no usable random seed from the host")
	} else if err := reseed(seed); err != nil {
		h.con.Printf("warning: fork: reseeding the random pool: %v", err)
	} else {
		h.con.Printf("fork: random pool reseeded (%d bytes from the host)", len(seed))
	}
	// The SSH host key (made in the fork's vTPM, through the kernel's
	// resource manager like the quote) while the network changes.
	keyDone := make(chan struct{})
	go func() {
		defer close(keyDone)
		if srv := h.sshd(); srv != nil {
			t := time.Now()
			if signer, err := ssh.NewSignerFromKey(loadHostKey(h.con)); err == nil {
				srv.SetHostKey(signer)
				h.con.Printf("fork: sshd host key %s (%s)", ssh.FingerprintSHA256(signer.PublicKey()), since(t))
			}
		}
	}()
	mac, err := net.ParseMAC(msg[ForkMACKey])
	if err != nil {
		h.con.Printf("warning: fork: MAC %q: %v; the network stays the parent's", msg[ForkMACKey], err)
	} else {
		t := time.Now()
		var static *netcfg.Lease
		if prev, ip := h.lease.Load(), net.ParseIP(msg[ForkIPKey]).To4(); prev != nil && ip != nil {
			l := *prev
			l.Addr = &net.IPNet{IP: ip, Mask: prev.Addr.Mask}
			static = &l
		}
		lease, err := netcfg.Reidentify(ctx, mac, static, netcfg.Options{Logf: h.con.Printf})
		if err != nil {
			h.con.Printf("warning: fork: network: %v", err)
		} else {
			h.lease.Store(lease) // a fork of this fork starts from it
			how := "by DHCP"
			if static != nil {
				how = "as the host said"
			}
			h.con.Printf("fork: MAC %s, address %s, %s (%s)", mac, lease, how, since(t))
		}
	}
	// Identity from the IMDS and the ready-stage quote side by side: both
	// only read the IMDS.
	idDone := make(chan struct{})
	go func() {
		defer close(idDone)
		t := time.Now()
		p := &provisioner{con: h.con, imds: imdsclient.New(imdsclient.DefaultURL), root: "/", setHostname: initsys.SetHostname}
		p.hostname(ctx)
		p.publicKeys(ctx)
		h.con.Printf("fork: hostname and keys from the IMDS (%s)", since(t))
	}()
	t := time.Now()
	res := tpmAttester(h.con, imdsclient.DefaultURL, attest.DefaultTPMPath)(ctx, attest.StageReady)
	if res != attestVerified {
		h.con.Printf("warning: fork: the ready-stage quote with the fork's key did not verify")
	}
	h.con.Printf("fork: ready-stage quote (%s)", since(t))
	<-idDone
	<-keyDone // sshd has the fork's host key by READY=1
	h.con.Printf("fork: ready (%s)", since(start))
	h.q.Send("READY=1", "STATUS=ready (forked)")
}

// reseed mixes seed into the kernel's pool, credited, and reseeds the CRNG
// at once (RNDADDENTROPY, then RNDRESEEDCRNG): the fork's pool was a copy of
// the parent's.
func reseed(seed []byte) error {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	buf := make([]byte, 8+len(seed))
	*(*int32)(unsafe.Pointer(&buf[0])) = int32(8 * len(seed)) // entropy_count, bits
	*(*int32)(unsafe.Pointer(&buf[4])) = int32(len(seed))     // buf_size
	copy(buf[8:], seed)
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDADDENTROPY, uintptr(unsafe.Pointer(&buf[0]))); e != 0 {
		return e
	}
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDRESEEDCRNG, 0); e != 0 {
		return e
	}
	return nil
}

func since(t time.Time) time.Duration { return time.Since(t).Round(time.Millisecond) }
