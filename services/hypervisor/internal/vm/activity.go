package vm

import (
	"github.com/giantswarm/vm-manager/services/hypervisor/internal/guestapi"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
)

// Activity is what keeps a VM from being idle and what makes its lifetime
// due: touches (IMDS requests, forwarded bytes, exec), holds and the idle
// clock, and the counters of what lifetimes did. The Manager carries out what
// is due; nothing here stops or deletes a VM.
type Activity struct {
	cfg   Config
	log   *slog.Logger
	table *Table
	// started is when this hypervisor started: an idle clock starts no earlier.
	started      time.Time
	lifetimeActs lifetimeActions
	// lifetimePasses counts finished checks of every VM's lifetime: "nothing
	// happened" is a result only after a pass that looked.
	lifetimePasses atomic.Uint64
}

// NewActivity tracks the activity of the Table's VMs from now on.
func NewActivity(cfg Config, log *slog.Logger, table *Table) *Activity {
	cfg.defaults()
	return &Activity{cfg: cfg, log: log, table: table, started: time.Now()}
}

// IMDSHandler is what each network's IMDS serves: the guest side's
// handler for that network, bounded by guard, traced while its caller boots
// and counted as its caller's activity. The network registry calls it.
func IMDSHandler(table *Table, activity *Activity, guest *guestapi.Side, guard *imds.Guard, log *slog.Logger) func(network string) http.Handler {
	return func(name string) http.Handler {
		return activity.activeIMDS(name, table.tracedIMDS(name, imds.New(guest.Network(name), guard, log.With("network", name))))
	}
}

// activeIMDS counts a guest's IMDS requests as activity of its VM, except
// its report uploads: vm-agent sends one every 15 s by itself, and a guest
// that only does that is idle.
func (ac *Activity) activeIMDS(network string, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !(r.Method == http.MethodPost && strings.TrimSuffix(r.URL.Path, "/") == imds.BasePath+"/report") {
			if mc := ac.table.leaseHolder(network, r.RemoteAddr); mc != nil {
				ac.touch(mc, ActivityIMDS)
			}
		}
		h.ServeHTTP(w, r)
	})
}

// leaseHolder is the VM holding the lease on a peer address in network, or nil.
func (tb *Table) leaseHolder(network, remoteAddr string) *machine {
	ip, ok := peerIP(remoteAddr)
	if !ok {
		return nil
	}
	tb.mu.Lock()
	defer tb.mu.Unlock()
	return tb.leases[lease{network, ip}]
}

// activeConn counts the bytes of a forwarded connection, either way, as
// activity of VM id (looked up once: touch is cheap per read).
func (ac *Activity) activeConn(id string, c net.Conn) net.Conn {
	mc, err := ac.table.get(id)
	if err != nil {
		return c
	}
	return &activeConn{Conn: c, touch: func() { ac.touch(mc, ActivityForward) }}
}

type activeConn struct {
	net.Conn
	touch func()
}

func (c *activeConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.touch()
	}
	return n, err
}

func (c *activeConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	if n > 0 {
		c.touch()
	}
	return n, err
}

// CloseWrite keeps the half-close the forward relies on.
func (c *activeConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Conn.Close()
}
