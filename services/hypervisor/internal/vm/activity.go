package vm

import (
	"net"
	"net/http"
	"strings"

	"github.com/giantswarm/vm-manager/services/hypervisor/internal/imds"
)

// activeIMDS counts a guest's IMDS requests as activity of its VM, except
// its report uploads: vm-agent sends one every 15 s by itself, and a guest
// that only does that is idle.
func (m *Manager) activeIMDS(network string, h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !(r.Method == http.MethodPost && strings.TrimSuffix(r.URL.Path, "/") == imds.BasePath+"/report") {
			if mc := m.leaseHolder(network, r.RemoteAddr); mc != nil {
				m.touch(mc, ActivityIMDS)
			}
		}
		h.ServeHTTP(w, r)
	})
}

// leaseHolder is the VM holding the lease on a peer address in network, or nil.
func (m *Manager) leaseHolder(network, remoteAddr string) *machine {
	ip, ok := peerIP(remoteAddr)
	if !ok {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.leases[lease{network, ip}]
}

// activeConn counts the bytes of a forwarded connection, either way, as
// activity of VM id (looked up once: touch is cheap per read).
func (m *Manager) activeConn(id string, c net.Conn) net.Conn {
	mc, err := m.get(id)
	if err != nil {
		return c
	}
	return &activeConn{Conn: c, touch: func() { m.touch(mc, ActivityForward) }}
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
