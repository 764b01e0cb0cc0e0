package vm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"

	hypervisorv1 "github.com/giantswarm/vm-manager/gen/vmmanager/hypervisor/v1"
	"github.com/giantswarm/vm-manager/sdk/apierr"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/forward"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/lifecycle"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/network"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/sshexec"
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/vmstore/storepb"
	"google.golang.org/protobuf/proto"
)

// Access is how callers reach into a VM through its network: exec over the
// guest's SSH server, port forwards, and what the host sees of it (Metrics).
// Each counts as the VM's activity.
type Access struct {
	cfg      Config
	log      *slog.Logger
	table    *Table
	nets     *network.Registry
	activity *Activity
	guest    Summaries
	refused  *Refusals
}

// Summaries are the guests' reports, summarised (guestapi.Side).
type Summaries interface {
	Summary(rec *storepb.VirtualMachine) (*hypervisorv1.GuestMetrics, string)
}

// NewAccess reaches the Table's VMs through nets; refused counts the
// forwards refused at their bound.
func NewAccess(cfg Config, log *slog.Logger, table *Table, nets *network.Registry, activity *Activity, guest Summaries, refused *Refusals) *Access {
	cfg.defaults()
	return &Access{cfg: cfg, log: log, table: table, nets: nets, activity: activity, guest: guest, refused: refused}
}

// sshPort is where the guest's SSH server listens (vm-agent in the test image).
const sshPort = 22

// newSSHKey gives a record its per-VM key: public half in the record (and
// public-keys/0 in the IMDS), private half written by prepare.
func newSSHKey(rec *storepb.VirtualMachine) ([]byte, error) {
	priv, pub, err := sshexec.NewKey("vm-manager@" + rec.GetId())
	if err != nil {
		return nil, err
	}
	rec.SshPublicKey = pub
	return priv, nil
}

// attachNIC connects the VM's NIC to its network until ctx ends (QEMU
// exited, or the hypervisor detaches); it dials QEMU's socket again after a
// disconnect, which is how a restarted hypervisor gets a re-adopted VM's
// network back.
func (rn *Runner) attachNIC(ctx context.Context, rec *storepb.VirtualMachine) {
	n := rn.nets.Running(rec.GetNetwork())
	if n == nil {
		rn.log.Warn("vm's network is gone; the VM runs without it", "vm", rec.GetId(), "network", rec.GetNetwork())
		return
	}
	if err := n.Attach(ctx, rec.GetId(), netSocket(rec)); err != nil {
		rn.log.Warn("vm's NIC not attached", "vm", rec.GetId(), "network", rec.GetNetwork(), "error", err)
	}
}

// netSocket is where QEMU's NIC listens.
func netSocket(rec *storepb.VirtualMachine) string {
	return rec.GetPaths().GetNetSocket()
}

// guestAddr is the VM's network and lease, or a conflict naming why there
// is none.
func (ax *Access) guestAddr(rec *storepb.VirtualMachine) (*network.Network, netip.Addr, error) {
	ip, err := netip.ParseAddr(rec.GetIp())
	if rec.GetNetwork() == "" || err != nil {
		return nil, netip.Addr{}, apierr.Errorf(apierr.Conflict, "vm %s has no network address", rec.GetId())
	}
	n := ax.nets.Running(rec.GetNetwork())
	if n == nil {
		return nil, netip.Addr{}, apierr.Errorf(apierr.Conflict, "vm %s: network %s is not running", rec.GetId(), rec.GetNetwork())
	}
	return n, ip, nil
}

// Exec runs argv as root in the guest over SSH (contract §7.4).
func (ax *Access) Exec(ctx context.Context, id string, argv []string) (*hypervisorv1.ExecVirtualMachineResponse, error) {
	if len(argv) == 0 {
		return nil, apierr.Invalidf("command", "command is required and must not be empty")
	}
	for i, w := range argv {
		if strings.ContainsRune(w, 0) {
			return nil, apierr.Invalidf("command", "command[%d] contains a NUL byte", i)
		}
	}
	t, err := ax.dialSSH(ctx, id)
	if err != nil {
		return nil, err
	}
	defer ax.activity.Hold(id, ActivityExec)()
	res, err := sshexec.Run(ctx, t.conn, t.key, t.pin, argv)
	switch {
	case err == nil:
	case errors.Is(err, sshexec.ErrHostKeyChanged):
		return nil, apierr.Errorf(apierr.Conflict, "host key of vm %s changed: %v", id, err)
	case errors.Is(err, context.DeadlineExceeded):
		return nil, apierr.Errorf(apierr.Timeout, "vm %s: exec did not finish before the deadline", id)
	case errors.Is(err, context.Canceled):
		return nil, apierr.Errorf(apierr.Timeout, "vm %s: exec cancelled by the caller", id)
	default:
		return nil, apierr.Errorf(apierr.Unavailable, "vm %s: exec over SSH failed: %v", id, err)
	}
	return &hypervisorv1.ExecVirtualMachineResponse{
		Stdout: string(res.Stdout), Stderr: string(res.Stderr),
		ExitCode: int32(res.ExitCode), Truncated: res.Truncated,
	}, nil
}

// sshTarget is a connection to a running guest's sshd, with the VM's
// client key and its pinned host key.
type sshTarget struct {
	conn net.Conn
	key  []byte
	pin  sshexec.PinFile
}

// dialSSH connects to VM id's sshd (exec, unary and streamed).
func (ax *Access) dialSSH(ctx context.Context, id string) (sshTarget, error) {
	mc, err := ax.table.get(id)
	if err != nil {
		return sshTarget{}, err
	}
	mc.mu.Lock()
	// A copy: updates change mc.rec in place once the lock is released.
	rec, live := proto.Clone(mc.rec).(*storepb.VirtualMachine), mc.run != nil
	mc.mu.Unlock()
	if !live || rec.GetState() == hypervisorv1.State_STATE_DELETING {
		return sshTarget{}, apierr.Errorf(apierr.Conflict, "vm %s is %s and has no running process; start it first", id, lifecycle.Name(rec.GetState()))
	}
	ns, ip, err := ax.guestAddr(rec)
	if err != nil {
		return sshTarget{}, err
	}
	key, err := os.ReadFile(rec.GetPaths().GetSshKey())
	if err != nil {
		return sshTarget{}, apierr.Errorf(apierr.Conflict, "vm %s has no per-VM SSH key (created by an older vm-manager?): %v", id, err)
	}
	dctx, cancel := context.WithTimeout(ctx, sshexec.HandshakeTimeout)
	conn, err := ns.DialContextTCP(dctx, net.JoinHostPort(ip.String(), strconv.Itoa(sshPort)))
	cancel()
	if err != nil {
		return sshTarget{}, apierr.Errorf(apierr.Unavailable, "vm %s: cannot reach SSH at %s:%d (is the guest up and serving SSH?): %v", id, ip, sshPort, err)
	}
	return sshTarget{conn: conn, key: key, pin: sshexec.PinFile(rec.GetPaths().GetSshHostKey())}, nil
}

// Forward proxies 127.0.0.1:<random> to the guest's port until the VM is
// deleted; asking again for the same guest port returns the same forward.
// Forwards are persisted and bound again after a hypervisor restart.
func (ax *Access) Forward(_ context.Context, id string, port int32) (*hypervisorv1.ForwardVirtualMachinePortResponse, error) {
	if port < 1 || port > 65535 {
		return nil, apierr.Invalidf("port", "port %d must be within 1..65535", port)
	}
	mc, err := ax.table.get(id)
	if err != nil {
		return nil, err
	}
	mc.op.Lock() // not while a delete runs
	defer mc.op.Unlock()
	if _, err := ax.table.get(id); err != nil {
		return nil, err
	}
	rec, _ := mc.snapshot()
	if rec.GetState() == hypervisorv1.State_STATE_DELETING {
		return nil, apierr.Errorf(apierr.Conflict, "vm %s is being deleted", id)
	}
	if _, _, err := ax.guestAddr(rec); err != nil {
		return nil, err
	}
	for _, f := range rec.GetForwards() {
		if f.GetPort() == port {
			return &hypervisorv1.ForwardVirtualMachinePortResponse{Id: id, Port: port, Address: f.GetAddress()}, nil
		}
	}
	if n, max := len(rec.GetForwards()), ax.cfg.Limits.MaxForwardsPerVM; n >= max {
		return nil, ax.refused.refuse(limitForwards, "vm %s has %d port forwards, the maximum is %d (--max-forwards-per-vm)", id, n, max)
	}
	f, err := forward.Listen("127.0.0.1:0", ax.guestDialer(rec, port), ax.log.With("vm", id, "port", port))
	if err != nil {
		return nil, apierr.Errorf(apierr.Internal, "vm %s: listen for a port forward: %v", id, err)
	}
	pf := &hypervisorv1.PortForward{Port: port, Address: f.Addr()}
	mc.mu.Lock()
	if mc.fwd == nil {
		mc.fwd = map[int32]*forward.Forward{}
	}
	mc.fwd[port] = f
	ax.table.updateLocked(mc, func(r *storepb.VirtualMachine) { r.Forwards = append(r.Forwards, pf) })
	mc.mu.Unlock()
	ax.log.Info("port forward", "vm", id, "port", port, "address", pf.GetAddress())
	return &hypervisorv1.ForwardVirtualMachinePortResponse{Id: id, Port: port, Address: pf.GetAddress()}, nil
}

// guestDialer reaches the VM's port through its network's stack, looked up
// per connection so a restarted network is found.
func (ax *Access) guestDialer(rec *storepb.VirtualMachine, port int32) forward.DialFunc {
	addr := net.JoinHostPort(rec.GetIp(), strconv.Itoa(int(port)))
	netName := rec.GetNetwork()
	return func(ctx context.Context) (net.Conn, error) {
		n := ax.nets.Running(netName)
		if n == nil {
			return nil, fmt.Errorf("network %s is not running", netName)
		}
		c, err := n.DialContextTCP(ctx, addr)
		if err != nil {
			return nil, err
		}
		return ax.activity.activeConn(rec.GetId(), c), nil
	}
}

// restoreForwards binds a loaded record's forwards again, on their old
// address when it is free (clients keep working), else on a new one.
func (ax *Access) restoreForwards(mc *machine) {
	rec, _ := mc.snapshot()
	if len(rec.GetForwards()) == 0 {
		return
	}
	if _, _, err := ax.guestAddr(rec); err != nil {
		ax.log.Warn("port forwards not restored", "vm", mc.id, "error", err)
		return
	}
	fwd := map[int32]*forward.Forward{}
	var kept []*hypervisorv1.PortForward
	for _, pf := range rec.GetForwards() {
		dial := ax.guestDialer(rec, pf.GetPort())
		log := ax.log.With("vm", mc.id, "port", pf.GetPort())
		f, err := forward.Listen(pf.GetAddress(), dial, log)
		if err != nil {
			log.Warn("port forward address taken; binding a new one", "address", pf.GetAddress(), "error", err)
			if f, err = forward.Listen("127.0.0.1:0", dial, log); err != nil {
				log.Error("port forward not restored", "error", err)
				continue
			}
		}
		fwd[pf.GetPort()] = f
		kept = append(kept, &hypervisorv1.PortForward{Port: pf.GetPort(), Address: f.Addr()})
	}
	mc.mu.Lock()
	mc.fwd = fwd
	ax.table.updateLocked(mc, func(r *storepb.VirtualMachine) { r.Forwards = kept })
	mc.mu.Unlock()
	ax.log.Info("port forwards restored", "vm", mc.id, "count", len(kept))
}

// closeForwards stops a VM's forwards; keepRecord leaves them in the record
// for the next hypervisor (a shutdown), else they are dropped (a delete).
func (ax *Access) closeForwards(mc *machine, keepRecord bool) {
	mc.mu.Lock()
	fwd := mc.fwd
	mc.fwd = nil
	if !keepRecord && len(mc.rec.GetForwards()) > 0 {
		ax.table.updateLocked(mc, func(r *storepb.VirtualMachine) { r.Forwards = nil })
	}
	mc.mu.Unlock()
	for _, port := range slices.Sorted(maps.Keys(fwd)) {
		_ = fwd[port].Close()
	}
}

// netMetrics is the network part of a VM's metrics.
func (ax *Access) netMetrics(rec *storepb.VirtualMachine) *hypervisorv1.NetworkMetrics {
	n := ax.nets.Running(rec.GetNetwork())
	if n == nil { // REQUIRED: the network's name, no counters
		return &hypervisorv1.NetworkMetrics{Name: rec.GetNetwork()}
	}
	st := n.Stats()
	vs := n.VMStats(rec.GetId())
	i64 := func(m map[string]uint64) map[string]int64 {
		out := make(map[string]int64, len(m))
		for k, v := range m {
			out[k] = int64(v)
		}
		return out
	}
	return &hypervisorv1.NetworkMetrics{
		Name:                    rec.GetNetwork(),
		BytesSent:               int64(st.BytesToVMs),
		BytesReceived:           int64(st.BytesFromVMs),
		Leases:                  int32(len(n.Leases())),
		DroppedFrames:           int64(vs.Dropped),
		EgressDropped:           int64(vs.EgressDroppedTotal()),
		EgressDroppedByReason:   i64(vs.EgressDropped),
		NatTcpFlows:             int32(vs.NATTCPFlows),
		NatUdpFlows:             int32(vs.NATUDPFlows),
		NatRefused:              i64(vs.NATRefused),
		DnsRefused:              i64(vs.DNSRefused),
		ImdsConnections:         int32(vs.IMDSConnections),
		ImdsConnectionsRefused:  int64(vs.IMDSRefused),
		ImdsConnectionsTimedOut: int64(vs.IMDSTimedOut),
	}
}
