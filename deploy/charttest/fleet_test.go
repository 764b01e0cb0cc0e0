package charttest

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
)

// unset is a claim template without storageClassName (the default class).
const unset = "<unset>"

const fleetTLS = "mode: fleet\nfleet: {tls: {secretName: vmm-tls}}\n"

// fleetWant is what one fleet rendering must hold besides the common checks.
type fleetWant struct {
	nodes, gateways    int32
	storageClass, size string // storageClass "" : none set
	tlsSecret          string
	certManager, oidc  bool
	muster             bool
	extraKinds         string
}

// FleetGateway returns the fleet gateway's Deployment.
func fleetGateway(t *testing.T, m *Manifest) *appsv1.Deployment {
	t.Helper()
	d := One[appsv1.Deployment](m)
	if d == nil || d.Name != "vm-manager-fleet" {
		t.Fatalf("the fleet gateway Deployment: %+v", d)
	}
	return d
}

func envFrom(c *corev1.Container, name string) *corev1.EnvVarSource {
	for _, e := range c.Env {
		if e.Name == name {
			return e.ValueFrom
		}
	}
	return nil
}

func sameLabels(a, b map[string]string) bool { return fmt.Sprint(a) == fmt.Sprint(b) }

// checkFleet asserts the fleet's objects: the node StatefulSet (one pod per
// KVM node, a claim each, the node index from the pod-index label), the
// headless Service, the fleet gateway with least-privilege RBAC, and the
// user-facing Service (and muster) on the fleet gateway only.
func checkFleet(t *testing.T, m *Manifest, w fleetWant) {
	t.Helper()
	sts := One[appsv1.StatefulSet](m)
	if sts == nil {
		t.Fatal("no StatefulSet")
	}
	pod := &sts.Spec.Template
	if sts.Name != "vm-manager-node" || sts.Spec.Replicas == nil || *sts.Spec.Replicas != w.nodes ||
		sts.Spec.ServiceName != "vm-manager-nodes" || sts.Spec.PodManagementPolicy != appsv1.ParallelPodManagement {
		t.Errorf("statefulset %s: replicas %v, serviceName %s, podManagementPolicy %s", sts.Name, sts.Spec.Replicas, sts.Spec.ServiceName, sts.Spec.PodManagementPolicy)
	}
	if !sameLabels(sts.Spec.Selector.MatchLabels, pod.Labels) || pod.Labels["app.kubernetes.io/component"] != "node" {
		t.Errorf("statefulset selector %v, pod labels %v", sts.Spec.Selector.MatchLabels, pod.Labels)
	}
	if p := sts.Spec.PersistentVolumeClaimRetentionPolicy; p == nil || p.WhenDeleted != appsv1.RetainPersistentVolumeClaimRetentionPolicyType || p.WhenScaled != appsv1.RetainPersistentVolumeClaimRetentionPolicyType {
		t.Errorf("claim retention %+v, want Retain", p)
	}
	if len(sts.Spec.VolumeClaimTemplates) != 1 {
		t.Fatalf("volumeClaimTemplates %+v", sts.Spec.VolumeClaimTemplates)
	}
	pvc := sts.Spec.VolumeClaimTemplates[0]
	sc := unset
	if pvc.Spec.StorageClassName != nil {
		sc = *pvc.Spec.StorageClassName
	}
	if q := pvc.Spec.Resources.Requests[corev1.ResourceStorage]; pvc.Name != "state" || q.String() != w.size || sc != w.storageClass ||
		!slices.Equal(pvc.Spec.AccessModes, []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}) {
		t.Errorf("claim template %s: size %s, class %q, modes %v; want %s, %q", pvc.Name, q.String(), sc, pvc.Spec.AccessModes, w.size, w.storageClass)
	}
	for _, v := range pod.Spec.Volumes {
		if v.Name == "state" {
			t.Errorf("the node pod has a state volume %+v besides the claim template", v)
		}
	}
	// One node pod per KVM node.
	aa := pod.Spec.Affinity
	if aa == nil || aa.PodAntiAffinity == nil || len(aa.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution) != 1 {
		t.Fatalf("affinity %+v, want one required anti-affinity term", aa)
	}
	term := aa.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution[0]
	if term.TopologyKey != "kubernetes.io/hostname" || term.LabelSelector == nil || !sameLabels(term.LabelSelector.MatchLabels, sts.Spec.Selector.MatchLabels) {
		t.Errorf("anti-affinity term %+v", term)
	}
	if pod.Spec.NodeSelector["vm-manager.giantswarm.io/kvm"] != "true" {
		t.Errorf("node pods' nodeSelector %v", pod.Spec.NodeSelector)
	}
	hv := Container(&pod.Spec, "hypervisor")
	if f := envFrom(hv, "VM_MANAGER_NODE_INDEX"); f == nil || f.FieldRef == nil || f.FieldRef.FieldPath != "metadata.labels['apps.kubernetes.io/pod-index']" {
		t.Errorf("VM_MANAGER_NODE_INDEX from %+v, want the pod-index label", f)
	}
	if f := envFrom(hv, "VM_MANAGER_NODE_NAME"); f == nil || f.FieldRef == nil || f.FieldRef.FieldPath != "spec.nodeName" {
		t.Errorf("VM_MANAGER_NODE_NAME from %+v, want spec.nodeName", f)
	}
	// The node gateway serves TLS from the Secret.
	gw := Container(&pod.Spec, "gateway")
	if !hasArg(gw, "--tls-cert-file=/etc/vm-manager/tls/tls.crt") || !hasArg(gw, "--tls-key-file=/etc/vm-manager/tls/tls.key") {
		t.Errorf("node gateway args %q lack the TLS files", gw.Args)
	}
	if mnt := MountFor(gw, "/etc/vm-manager/tls/tls.key"); mnt == nil || mnt.Name != "tls" || !mnt.ReadOnly {
		t.Errorf("node gateway's TLS mount %+v", mnt)
	}
	for _, p := range []*corev1.Probe{gw.LivenessProbe, gw.ReadinessProbe} {
		if p.HTTPGet.Scheme != corev1.URISchemeHTTPS {
			t.Errorf("node gateway probe %s over %s, want HTTPS", p.HTTPGet.Path, p.HTTPGet.Scheme)
		}
	}
	for _, v := range pod.Spec.Volumes {
		if v.Name == "tls" && (v.Secret == nil || v.Secret.SecretName != w.tlsSecret) {
			t.Errorf("tls volume %+v, want secret %s", v, w.tlsSecret)
		}
	}

	// The headless Service whose EndpointSlices the fleet gateway follows.
	hs := m.Service("vm-manager-nodes")
	if hs == nil || hs.Spec.ClusterIP != corev1.ClusterIPNone || hs.Spec.PublishNotReadyAddresses ||
		!sameLabels(hs.Spec.Selector, sts.Spec.Selector.MatchLabels) || len(hs.Spec.Ports) != 1 ||
		hs.Spec.Ports[0].Name != "grpc" || hs.Spec.Ports[0].TargetPort.String() != "http" {
		t.Errorf("headless service %+v", hs)
	}

	// The fleet gateway: its own ServiceAccount, allowed exactly
	// get/list/watch on endpointslices in the namespace.
	d := fleetGateway(t, m)
	if d.Spec.Replicas == nil || *d.Spec.Replicas != w.gateways {
		t.Errorf("fleet gateway replicas %v, want %d", d.Spec.Replicas, w.gateways)
	}
	fp := &d.Spec.Template.Spec
	if fp.ServiceAccountName != "vm-manager-fleet" || fp.AutomountServiceAccountToken == nil || !*fp.AutomountServiceAccountToken {
		t.Errorf("fleet gateway service account %s, automount %v", fp.ServiceAccountName, fp.AutomountServiceAccountToken)
	}
	if d.Spec.Template.Labels["app.kubernetes.io/component"] != "fleet-gateway" || !sameLabels(d.Spec.Selector.MatchLabels, d.Spec.Template.Labels) {
		t.Errorf("fleet gateway labels %v, selector %v", d.Spec.Template.Labels, d.Spec.Selector.MatchLabels)
	}
	if len(fp.Containers) != 1 || len(fp.InitContainers) != 0 {
		t.Fatalf("fleet gateway containers %+v", fp.Containers)
	}
	fg := &fp.Containers[0]
	if !slices.Equal(fg.Command, []string{"/usr/local/bin/vmm-gateway", "serve"}) || !strings.HasSuffix(strings.Split(fg.Image, ":")[0], "-gateway") {
		t.Errorf("fleet gateway command %q image %s", fg.Command, fg.Image)
	}
	for _, a := range []string{"--listen=:8080", "--fleet-discovery=kubernetes", "--fleet-service=vm-manager-nodes", "--fleet-port-name=grpc",
		"--fleet-ca-file=/etc/vm-manager/fleet-ca/ca.crt", "--fleet-server-name-suffix=vm-manager-nodes.agent-platform.svc"} {
		if !hasArg(fg, a) {
			t.Errorf("fleet gateway args %q lack %s", fg.Args, a)
		}
	}
	if hasArg(fg, "--allow-anonymous-non-loopback") == w.oidc {
		t.Errorf("fleet gateway args %q with oidc=%v", fg.Args, w.oidc)
	}
	if w.oidc && env(fg)["VM_MANAGER_OIDC_ISSUER"] == "" {
		t.Errorf("fleet gateway env %v lacks the issuer", fg.Env)
	}
	checkRestricted(t, "fleet-gateway", fg.SecurityContext)
	for _, v := range fp.Volumes {
		if v.HostPath != nil || v.PersistentVolumeClaim != nil {
			t.Errorf("fleet gateway volume %+v", v)
		}
		if v.Secret != nil && v.Secret.SecretName == w.tlsSecret && (len(v.Secret.Items) != 1 || v.Secret.Items[0].Key != "ca.crt") {
			t.Errorf("the fleet gateway mounts more of the node TLS Secret than ca.crt: %+v", v.Secret.Items)
		}
	}
	if mnt := MountFor(fg, "/etc/vm-manager/fleet-ca/ca.crt"); mnt == nil || mnt.Name != "fleet-ca" || !mnt.ReadOnly {
		t.Errorf("fleet gateway's CA mount %+v", mnt)
	}
	if fg.ReadinessProbe == nil || fg.ReadinessProbe.HTTPGet.Path != "/readyz" || fg.LivenessProbe == nil || fg.LivenessProbe.HTTPGet.Path != "/healthz" {
		t.Errorf("fleet gateway probes %+v %+v", fg.LivenessProbe, fg.ReadinessProbe)
	}
	role := One[rbacv1.Role](m)
	want := []rbacv1.PolicyRule{{APIGroups: []string{"discovery.k8s.io"}, Resources: []string{"endpointslices"}, Verbs: []string{"get", "list", "watch"}}}
	if role == nil || fmt.Sprint(role.Rules) != fmt.Sprint(want) {
		t.Errorf("role %+v, want rules %+v", role, want)
	}
	rb := One[rbacv1.RoleBinding](m)
	if rb == nil || rb.RoleRef.Kind != "Role" || rb.RoleRef.Name != role.Name || len(rb.Subjects) != 1 ||
		rb.Subjects[0].Kind != "ServiceAccount" || rb.Subjects[0].Name != fp.ServiceAccountName || rb.Subjects[0].Namespace != Namespace {
		t.Errorf("rolebinding %+v", rb)
	}
	var fleetSA bool
	for _, sa := range All[corev1.ServiceAccount](m) {
		fleetSA = fleetSA || sa.Name == fp.ServiceAccountName
	}
	if !fleetSA {
		t.Errorf("no ServiceAccount %s", fp.ServiceAccountName)
	}

	// Users (and muster) reach the fleet gateway, never a node pod directly.
	svc := m.Service(ReleaseName)
	if svc == nil || !sameLabels(svc.Spec.Selector, d.Spec.Selector.MatchLabels) {
		t.Errorf("the Service selects %v, want the fleet gateway's %v", svc.Spec.Selector, d.Spec.Selector.MatchLabels)
	}
	if w.muster {
		if s := One[MCPServer](m); s == nil || s.Spec.URL != "http://vm-manager.agent-platform.svc:8080/mcp" {
			t.Errorf("mcpserver %+v", s)
		}
	}
	c := One[Certificate](m)
	if w.certManager != (c != nil) {
		t.Fatalf("certificate %+v, want one: %v", c, w.certManager)
	}
	if c != nil && (c.Spec.SecretName != w.tlsSecret || !slices.Equal(c.Spec.DNSNames, []string{"*.vm-manager-nodes.agent-platform.svc", "*.vm-manager-nodes.agent-platform.svc.cluster.local"}) ||
		!slices.Equal(c.Spec.Usages, []string{"server auth"}) || c.Spec.IssuerRef.Name == "") {
		t.Errorf("certificate %+v", c.Spec)
	}
}

// TestFleetTemplate renders mode=fleet for several value sets and checks the
// fleet's objects; the existing modes' renderings are TestTemplate's.
func TestFleetTemplate(t *testing.T) {
	for _, tc := range []struct {
		name, vals, kinds string
		want              fleetWant
	}{{
		name:  "defaults with a TLS Secret",
		vals:  anonymous + fleetTLS,
		kinds: "Deployment=1,Role=1,RoleBinding=1,Service=2,ServiceAccount=2,StatefulSet=1",
		want:  fleetWant{nodes: 1, gateways: 2, storageClass: unset, size: "50Gi", tlsSecret: "vmm-tls"},
	}, {
		name: "local storage class and size, replicas, cert-manager, OIDC, muster",
		vals: oidcOn + `
mode: fleet
fleet:
  nodes: 5
  storage: {storageClass: local-path, size: 200Gi}
  tls: {certManager: {enabled: true, issuerRef: {name: lab-ca, kind: ClusterIssuer}}}
  gateway: {replicas: 3}
muster: {mcpServer: {enabled: true}}
`,
		kinds: "Certificate=1,Deployment=1,MCPServer=1,Role=1,RoleBinding=1,Service=2,ServiceAccount=2,StatefulSet=1",
		want:  fleetWant{nodes: 5, gateways: 3, storageClass: "local-path", size: "200Gi", tlsSecret: "vm-manager-nodes-tls", certManager: true, oidc: true, muster: true},
	}, {
		name:  "cert-manager into a named Secret, no provisioning",
		vals:  anonymous + "mode: fleet\nfleet: {storage: {storageClass: '-'}, tls: {secretName: node-certs, certManager: {enabled: true, issuerRef: {name: ca}}}}\n",
		kinds: "Certificate=1,Deployment=1,Role=1,RoleBinding=1,Service=2,ServiceAccount=2,StatefulSet=1",
		want:  fleetWant{nodes: 1, gateways: 2, storageClass: "", size: "50Gi", tlsSecret: "node-certs", certManager: true},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			m, manifest := render(t, values(t, tc.vals))
			if kinds(m) != tc.kinds {
				t.Errorf("kinds %s, want %s", kinds(m), tc.kinds)
			}
			checkPod(t, m, manifest)
			checkFleet(t, m, tc.want)
		})
	}
	for _, tc := range []struct{ name, vals, want string }{
		{"no TLS", anonymous + "mode: fleet\n", "mode=fleet needs the node gateways' TLS"},
		{"cert-manager without an issuer", anonymous + "mode: fleet\nfleet: {tls: {certManager: {enabled: true}}}\n", "needs fleet.tls.certManager.issuerRef.name"},
		{"a claim of the chart", anonymous + fleetTLS + "persistence: {create: true}\n", "mode=fleet gives each node pod its own claim"},
		{"no nodes", anonymous + "mode: fleet\nfleet: {nodes: 0, tls: {secretName: x}}\n", "at '/fleet/nodes'"},
	} {
		t.Run("refuses "+tc.name, func(t *testing.T) {
			_, err := Render(ChartDir, values(t, tc.vals))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("render: %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
