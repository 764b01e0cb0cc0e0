package cluster

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Fleet is several "nodes", each a Cluster (attestation + hypervisor +
// gateway with its own state, its gateway serving TLS), behind a fleet
// gateway that finds them in a static list (--fleet-nodes). Processes
// mode only.
type Fleet struct {
	Nodes []*Cluster
	Names []string // node-0, node-1, ...
	Addr  string   // the fleet gateway's host:port (plaintext, loopback)
	// CAFile is the PEM of the CA that signed the node gateways'
	// certificate; Client trusts it.
	CAFile string
	Client *http.Client

	t      testing.TB
	binDir string
	dir    string
	gw     *osProc
	logs   *logSink
}

// StartFleet starts n nodes and the fleet gateway in front of them. Node i
// runs with --node-index=i, --node-name=node-i and --node-labels=labels(i).
func StartFleet(t testing.TB, binDir string, n int, opts Options, labels func(i int) string) *Fleet {
	t.Helper()
	dir := TempDir(t)
	ca, cert, key := writeTestPKI(t, dir)
	client, err := TLSClient(ca)
	if err != nil {
		t.Fatal(err)
	}
	f := &Fleet{CAFile: ca, Client: client, t: t, binDir: binDir, dir: dir, logs: &logSink{t: t, quiet: opts.Quiet, dir: dir}}
	var list []string
	for i := range n {
		o := opts
		o.TLSCertFile, o.TLSKeyFile, o.TLSCAFile = cert, key, ca
		name := fmt.Sprintf("node-%d", i)
		o.Env = append(append([]string(nil), opts.Env...),
			fmt.Sprintf("VM_MANAGER_NODE_INDEX=%d", i), "VM_MANAGER_NODE_NAME="+name, "VM_MANAGER_NODE_LABELS="+labels(i))
		c := Start(t, Processes, binDir, o)
		f.Nodes = append(f.Nodes, c)
		f.Names = append(f.Names, name)
		list = append(list, fmt.Sprintf("%s=%d@%s", name, i, c.Addr))
	}
	f.Addr = FreeAddr(t)
	cmd := exec.Command(filepath.Join(binDir, "vmm-gateway"), "serve")
	cmd.Env = append(os.Environ(),
		"VM_MANAGER_LISTEN="+f.Addr,
		"VM_MANAGER_RUN_DIR="+filepath.Join(dir, "run"),
		"VM_MANAGER_FLEET_NODES="+strings.Join(list, ","),
		"VM_MANAGER_FLEET_CA_FILE="+ca,
		"VM_MANAGER_METRICS_ENABLED=true",
		"VM_MANAGER_LOG_LEVEL=debug",
		"VM_MANAGER_OIDC_ISSUER="+opts.OIDCIssuer,
		"VM_MANAGER_OIDC_AUDIENCES="+strings.Join(opts.OIDCAudiences, ","),
	)
	w := f.logs.writer("fleet-gateway")
	cmd.Stdout, cmd.Stderr = w, w
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	f.gw = &osProc{cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(f.gw.done) }()
	t.Cleanup(func() { _ = f.gw.stop(); f.logs.close() })
	waitFor(t, 30*time.Second, "fleet gateway /readyz", func() error { return Readyz(f.Addr) })
	return f
}

// StopNode SIGKILLs a node's three processes (its VMs' QEMU and swtpm keep
// running, as when a pod's containers die).
func (f *Fleet) StopNode(i int) {
	f.t.Helper()
	for s := len(Services) - 1; s >= 0; s-- {
		f.Nodes[i].StopService(Services[s])
	}
}

// StartNode starts a stopped node's processes again on the same state,
// sockets and address, and waits for its gateway.
func (f *Fleet) StartNode(i int) {
	f.t.Helper()
	for _, s := range Services {
		f.Nodes[i].StartService(s)
	}
	f.Nodes[i].WaitReady(30 * time.Second)
}

// GatewayPid is the fleet gateway's process id.
func (f *Fleet) GatewayPid() int { return f.gw.cmd.Process.Pid }

// TLSClient is an HTTP client trusting the CA in caFile.
func TLSClient(caFile string) (*http.Client, error) {
	pemBytes, err := os.ReadFile(caFile)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pemBytes) {
		return nil, fmt.Errorf("%s: no certificate", caFile)
	}
	return &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}}, nil
}

// writeTestPKI writes a CA and one server certificate for 127.0.0.1 and
// localhost signed by it (every test node uses it), returning the files.
func writeTestPKI(t testing.TB, dir string) (caFile, certFile, keyFile string) {
	t.Helper()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "vmm test fleet CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "vmm test node"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	write := func(name, typ string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: b}), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	return write("ca.pem", "CERTIFICATE", caDER), write("node.pem", "CERTIFICATE", der), write("node-key.pem", "EC PRIVATE KEY", keyDER)
}
