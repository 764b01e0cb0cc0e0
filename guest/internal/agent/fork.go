package agent

import (
	"context"
	"encoding/hex"
	"net"
	"os"
	"strings"
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
//   - the NIC's new MAC, and DHCP for the fork's address;
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
)

// hostListener reads what the host sends on the notify port.
type hostListener struct {
	con   *Console
	q     *queue
	sshd  func() *sshd.Server // nil server: none runs
	forks chan map[string]string
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
	mac, err := net.ParseMAC(msg[ForkMACKey])
	if err != nil {
		h.con.Printf("warning: fork: MAC %q: %v; the network stays the parent's", msg[ForkMACKey], err)
	} else {
		lease, err := netcfg.Reidentify(ctx, mac, netcfg.Options{Logf: h.con.Printf})
		if err != nil {
			h.con.Printf("warning: fork: network: %v", err)
		} else {
			h.con.Printf("fork: MAC %s, address %s", mac, lease)
		}
	}
	if srv := h.sshd(); srv != nil {
		if signer, err := ssh.NewSignerFromKey(loadHostKey(h.con)); err == nil {
			srv.SetHostKey(signer)
			h.con.Printf("fork: sshd host key %s", ssh.FingerprintSHA256(signer.PublicKey()))
		}
	}
	p := &provisioner{con: h.con, imds: imdsclient.New(imdsclient.DefaultURL), root: "/", setHostname: initsys.SetHostname}
	p.hostname(ctx)
	p.publicKeys(ctx)
	res := tpmAttester(h.con, imdsclient.DefaultURL, attest.DefaultTPMPath)(ctx, attest.StageReady)
	if res != attestVerified {
		h.con.Printf("warning: fork: the ready-stage quote with the fork's key did not verify")
	}
	h.con.Printf("fork: ready (%s)", time.Since(start).Round(time.Millisecond))
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
