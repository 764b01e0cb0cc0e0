package charttest

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/giantswarm/vm-manager/tests/cluster"
	corev1 "k8s.io/api/core/v1"
)

// Pod paths of the fleet's TLS mounts.
const (
	tlsDir     = "/etc/vm-manager/tls"
	fleetCADir = "/etc/vm-manager/fleet-ca"
)

// nodeTLS writes what the fleet's TLS Secret holds (a CA, and a certificate
// for every node pod's name under the headless Service, plus 127.0.0.1 for
// the static list this test swaps in) into dir.
func nodeTLS(t *testing.T, dir string) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "vmm-test-ca"}, IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour)}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	leaf := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "vm-manager-nodes"},
		DNSNames:    []string{"*.vm-manager-nodes.agent-platform.svc"},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, KeyUsage: x509.KeyUsageDigitalSignature,
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour)}
	der, err := x509.CreateCertificate(rand.Reader, leaf, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalECPrivateKey(key)
	for name, block := range map[string]*pem.Block{
		"ca.crt":  {Type: "CERTIFICATE", Bytes: caDER},
		"tls.crt": {Type: "CERTIFICATE", Bytes: der},
		"tls.key": {Type: "EC PRIVATE KEY", Bytes: keyDER},
	} {
		if err := os.WriteFile(filepath.Join(dir, name), pem.EncodeToMemory(block), 0o600); err != nil {
			t.Fatal(err)
		}
	}
}

// withFieldRefs is c with its downward-API variables resolved as the kubelet
// would for pod <sts>-<ordinal> on node nodeName; any other valueFrom fails.
func withFieldRefs(t *testing.T, c corev1.Container, ordinal int, nodeName string) *corev1.Container {
	t.Helper()
	c.Env = append([]corev1.EnvVar(nil), c.Env...)
	for i, e := range c.Env {
		if e.ValueFrom == nil {
			continue
		}
		if e.ValueFrom.FieldRef == nil {
			t.Fatalf("%s: env %s from %+v", c.Name, e.Name, e.ValueFrom)
		}
		switch e.ValueFrom.FieldRef.FieldPath {
		case "metadata.labels['apps.kubernetes.io/pod-index']":
			c.Env[i] = corev1.EnvVar{Name: e.Name, Value: fmt.Sprint(ordinal)}
		case "spec.nodeName":
			c.Env[i] = corev1.EnvVar{Name: e.Name, Value: nodeName}
		default:
			t.Fatalf("%s: env %s from field %s", c.Name, e.Name, e.ValueFrom.FieldRef.FieldPath)
		}
	}
	return &c
}

// TestRenderedFleetRuns runs mode=fleet's rendered pods as local processes:
// node pod 0's three containers with their rendered commands, arguments and
// environments (paths and the port mapped, the downward API resolved as the
// kubelet would: ordinal 0, node kvm-0), serving TLS from a Secret's files;
// and the fleet gateway with its rendered arguments except discovery, which
// is the static list naming that node (no API server here; the Kubernetes
// discovery is the fleet/kube package's tests, against client-go's fake
// clientset and a fake API server). Through the fleet gateway a VM is
// created (its id names node 0), read, exec'd in and listed; the node pod
// restarts (all three processes, as a pod restart) with the same state
// directory (the pod's claim) and the VM is still there.
func TestRenderedFleetRuns(t *testing.T) {
	images := cluster.GuestImages(t, "../..")
	binDir := t.TempDir()
	if err := cluster.BuildBinaries(binDir); err != nil {
		t.Fatal(err)
	}

	m, manifest := render(t, values(t, anonymous+fleetTLS+"guestImage: {enabled: false}\nmetrics: {enabled: true}\n"))
	nodePod := checkPod(t, m, manifest)
	fleetPod := fleetGateway(t, m).Spec.Template.Spec

	dir := cluster.TempDir(t)
	secret := filepath.Join(dir, "tls")
	if err := os.MkdirAll(secret, 0o700); err != nil {
		t.Fatal(err)
	}
	nodeTLS(t, secret)
	nodeAddr, fleetAddr := cluster.FreeAddr(t), cluster.FreeAddr(t)
	r := rewriter{binDir: binDir, state: filepath.Join(dir, "state"), run: filepath.Join(dir, "run"), listen: nodeAddr,
		port: Container(&nodePod.Spec, "gateway").Ports[0].ContainerPort, more: [][2]string{{tlsDir, secret}, {fleetCADir, secret}}}
	// The guest images, as the init container (off here) would have put them.
	if err := os.MkdirAll(r.path(imageDir), 0o700); err != nil {
		t.Fatal(err)
	}
	run(t, "cp", "-a", publishedTree(t, images)+"/.", r.path(imageDir))

	var order []string
	procs := map[string]*process{}
	for _, c := range nodePod.Spec.Containers {
		procs[c.Name] = processFor(t, withFieldRefs(t, c, 0, "kvm-0"), r, dir)
		order = append(order, c.Name)
	}
	// The fleet gateway: rendered, discovery swapped for the static list.
	fc := fleetPod.Containers[0]
	fc.Args = append([]string(nil), fc.Args...)
	for i, a := range fc.Args {
		if a == "--fleet-discovery=kubernetes" {
			fc.Args[i] = "--fleet-discovery=static"
		}
	}
	fc.Args = append(fc.Args, "--fleet-nodes=vm-manager-node-0=0@"+nodeAddr)
	fr := r
	fr.listen = fleetAddr
	fleetProc := processFor(t, &fc, fr, dir)

	var vm vmRecord
	t.Cleanup(func() {
		fleetProc.stop(syscall.SIGTERM, 10*time.Second)
		for i := len(order) - 1; i >= 0; i-- {
			procs[order[i]].stop(syscall.SIGTERM, 45*time.Second)
		}
		if vm.Processes != nil {
			cluster.KillLeftovers(t, vm.Processes.Qemu.Pid, vm.Processes.Tpm.Pid)
		}
		if t.Failed() {
			for _, p := range append([]*process{fleetProc}, procs["hypervisor"], procs["gateway"]) {
				b, _ := os.ReadFile(p.log)
				lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
				if len(lines) > 40 {
					lines = lines[len(lines)-40:]
				}
				t.Logf("--- %s log:\n%s", p.name, strings.Join(lines, "\n"))
			}
		}
	})

	// The node gateway serves TLS with the Secret's certificate, verified
	// for the pod's name under the headless Service, as the fleet gateway
	// verifies it.
	caPEM, _ := os.ReadFile(filepath.Join(secret, "ca.crt"))
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	nodeClient := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{
		RootCAs: pool, ServerName: "vm-manager-node-0.vm-manager-nodes.agent-platform.svc"}}}
	nodeReady := func(what string) {
		t.Helper()
		cluster.Eventually(t, 60*time.Second, "node pod /readyz over TLS "+what, func() error {
			for _, name := range order {
				if !procs[name].running() {
					t.Fatalf("%s exited", name)
				}
			}
			resp, err := nodeClient.Get("https://" + nodeAddr + "/readyz")
			if err != nil {
				return err
			}
			resp.Body.Close()
			if resp.StatusCode != 200 {
				return fmt.Errorf("readyz: %d", resp.StatusCode)
			}
			return nil
		})
	}
	for _, name := range order {
		procs[name].start(t)
	}
	fleetProc.start(t)
	nodeReady("after start")
	cluster.Eventually(t, 30*time.Second, "fleet gateway /readyz", func() error {
		if !fleetProc.running() {
			t.Fatal("the fleet gateway exited")
		}
		return cluster.Readyz(fleetAddr)
	})

	base := "http://" + fleetAddr
	call(t, "GET", base+"/api/v1/host", "", 200)
	body := `{"name":"fleet","image":"test-guest","require_attestation":false,"memory_mib":384,"cpus":1}`
	if err := json.Unmarshal(call(t, "POST", base+"/api/v1/vms", body, 201), &vm); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(vm.ID, "000") || vm.State != "ready" {
		t.Fatalf("created through the fleet: %+v, want a ready VM whose id names node 0", vm)
	}
	t.Logf("vm %s ready through the fleet gateway", vm.ID)
	var out struct {
		Stdout   string `json:"stdout"`
		ExitCode int    `json:"exitCode"`
	}
	if err := json.Unmarshal(call(t, "POST", base+"/api/v1/vms/"+vm.ID+"/exec", `{"command":["hostname"]}`, 200), &out); err != nil || out.Stdout != "fleet\n" {
		t.Fatalf("exec through the fleet: %v %+v", err, out)
	}
	if list := string(call(t, "GET", base+"/api/v1/vms", "", 200)); !strings.Contains(list, vm.ID) {
		t.Fatalf("the fleet's list lacks %s: %s", vm.ID, list)
	}

	// Golden values imported through the fleet (fleet-wide policy) must
	// outlive the pod's restart too: they live in attestation's bbolt file
	// on the claim.
	golden := strings.Repeat("ab", 32)
	zeros := strings.Repeat("00", 32)
	policy := fmt.Sprintf(`{"image_id":"fleet-image","image_version":"1.0.0","golden":{"sha256":{"2":"%[2]s","3":"%[2]s","4":"%[2]s","6":"%[2]s","7":"%[1]s"}}}`, golden, zeros)
	call(t, "PUT", base+"/api/v1/images/fleet-image_1.0.0/policy", policy, 200)

	// A pod restart: all three containers end (the hypervisor powers the
	// VM down) and start again on the same claim.
	for i := len(order) - 1; i >= 0; i-- {
		procs[order[i]].stop(syscall.SIGTERM, 45*time.Second)
	}
	for _, name := range order {
		procs[name].start(t)
	}
	nodeReady("after the pod's restart")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var again vmRecord
	cluster.Eventually(t, 30*time.Second, "the VM through the fleet after the node pod's restart", func() error {
		code, _, b := cluster.DoContext(ctx, t, "GET", base+"/api/v1/vms/"+vm.ID, "", nil)
		if code != 200 {
			return fmt.Errorf("%d: %s", code, b)
		}
		return json.Unmarshal(b, &again)
	})
	if again.ID != vm.ID || again.Name != "fleet" {
		t.Fatalf("after the restart: %+v", again)
	}
	if got := string(call(t, "GET", base+"/api/v1/images/fleet-image_1.0.0/policy", "", 200)); !strings.Contains(got, golden) {
		t.Fatalf("the golden values after the pod's restart: %s", got)
	}
	call(t, "DELETE", base+"/api/v1/vms/"+vm.ID, "", 204)
}
