package charttest

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chartutil"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	"sigs.k8s.io/yaml"
)

// Paths inside the pod the processes are configured with.
const (
	stateDir = "/var/lib/vm-manager"
	imageDir = "/var/lib/vm-manager/images"
	runDir   = "/run/vm-manager"
)

// values parses YAML test values.
func values(t *testing.T, y string) map[string]any {
	t.Helper()
	var v map[string]any
	if err := yaml.UnmarshalStrict([]byte(y), &v); err != nil {
		t.Fatalf("test values: %v", err)
	}
	return v
}

// render renders and strictly decodes the chart with vals.
func render(t *testing.T, vals map[string]any) (*Manifest, string) {
	t.Helper()
	rel, err := Render(ChartDir, vals)
	if err != nil {
		t.Fatalf("render: %v", err)
	}
	m, err := Decode(rel.Manifest)
	if err != nil {
		t.Fatalf("decode: %v\n%s", err, rel.Manifest)
	}
	return m, rel.Manifest
}

func env(c *corev1.Container) map[string]string {
	e := map[string]string{}
	for _, v := range c.Env {
		e[v.Name] = v.Value
	}
	return e
}

func hasArg(c *corev1.Container, arg string) bool { return slices.Contains(c.Args, arg) }

// checkPod asserts what every rendering of the pod must hold.
func checkPod(t testing.TB, m *Manifest, manifest string) *corev1.PodTemplateSpec {
	t.Helper()
	if strings.Contains(manifest, "hostPath") {
		t.Errorf("the manifest mentions hostPath")
	}
	tpl, err := m.PodSpec()
	if err != nil {
		t.Fatal(err)
	}
	pod := &tpl.Spec
	for _, v := range pod.Volumes {
		if v.HostPath != nil {
			t.Errorf("volume %s is a hostPath", v.Name)
		}
	}
	if pod.AutomountServiceAccountToken == nil || *pod.AutomountServiceAccountToken {
		t.Errorf("automountServiceAccountToken: %v", pod.AutomountServiceAccountToken)
	}
	if pod.TerminationGracePeriodSeconds == nil || *pod.TerminationGracePeriodSeconds != 90 {
		t.Errorf("terminationGracePeriodSeconds: %v", pod.TerminationGracePeriodSeconds)
	}
	psc := pod.SecurityContext
	if psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser == 0 || psc.FSGroup == nil {
		t.Errorf("pod security context: %+v", psc)
	}
	var names []string
	for _, c := range pod.Containers {
		names = append(names, c.Name)
	}
	if !slices.Equal(names, []string{"hypervisor", "attestation", "gateway"}) {
		t.Fatalf("containers %v", names)
	}
	for _, name := range names {
		c := Container(pod, name)
		if want := []string{"/usr/local/bin/vmm-" + name, "serve"}; !slices.Equal(c.Command, want) {
			t.Errorf("%s: command %q, want %q", name, c.Command, want)
		}
		if i := strings.LastIndex(c.Image, ":"); i < 0 || !strings.HasSuffix(c.Image[:i], "-"+name) {
			t.Errorf("%s: image %s is not the component's", name, c.Image)
		}
		e := env(c)
		if e["VM_MANAGER_RUN_DIR"] != runDir {
			t.Errorf("%s: VM_MANAGER_RUN_DIR=%q", name, e["VM_MANAGER_RUN_DIR"])
		}
		// The run directory is shared by all three through one emptyDir,
		// mounted at its parent: the processes create the directory (0700,
		// their own) and its sockets (0600) themselves.
		mnt := MountFor(c, runDir)
		if mnt == nil || mnt.Name != "run" || mnt.MountPath == runDir {
			t.Errorf("%s: the run directory's mount: %+v", name, mnt)
		}
	}
	for _, v := range pod.Volumes {
		if v.Name == "run" && v.EmptyDir == nil {
			t.Errorf("the run volume is not an emptyDir: %+v", v)
		}
	}
	for _, name := range []string{"hypervisor", "attestation"} {
		c := Container(pod, name)
		if e := env(c); e["VM_MANAGER_STATE_DIR"] != stateDir {
			t.Errorf("%s: VM_MANAGER_STATE_DIR=%q", name, e["VM_MANAGER_STATE_DIR"])
		}
		if mnt := MountFor(c, stateDir); mnt == nil || mnt.Name != "state" || mnt.ReadOnly {
			t.Errorf("%s: the state directory's mount: %+v", name, mnt)
		}
	}
	hv := Container(pod, "hypervisor")
	if env(hv)["VM_MANAGER_IMAGE_DIR"] != imageDir {
		t.Errorf("hypervisor: VM_MANAGER_IMAGE_DIR=%q", env(hv)["VM_MANAGER_IMAGE_DIR"])
	}
	if !hasArg(hv, "--detach-vms-on-exit=false") {
		t.Errorf("hypervisor args %q lack --detach-vms-on-exit=false", hv.Args)
	}
	for _, name := range []string{"attestation", "gateway"} {
		checkRestricted(t, name, Container(pod, name).SecurityContext)
	}
	gw := Container(pod, "gateway")
	if !hasArg(gw, "--listen=:8080") {
		t.Errorf("gateway args %q lack --listen=:8080", gw.Args)
	}
	if len(gw.Ports) != 1 || gw.Ports[0].Name != "http" || gw.Ports[0].ContainerPort != 8080 {
		t.Errorf("gateway ports %+v", gw.Ports)
	}
	for probe, p := range map[string]*corev1.Probe{"/healthz": gw.LivenessProbe, "/readyz": gw.ReadinessProbe} {
		if p == nil || p.HTTPGet == nil || p.HTTPGet.Path != probe || p.HTTPGet.Port.String() != "http" {
			t.Errorf("gateway probe %s: %+v", probe, p)
		}
	}
	if mnt := MountFor(gw, stateDir); mnt != nil {
		t.Errorf("the gateway mounts the state: %+v", mnt)
	}
	if svc := m.Service(ReleaseName); svc == nil || svc.Spec.Type != corev1.ServiceTypeClusterIP || len(svc.Spec.Ports) != 1 ||
		svc.Spec.Ports[0].Name != "http" || svc.Spec.Ports[0].TargetPort.String() != "http" {
		t.Errorf("service: %+v", svc)
	}
	return tpl
}

// checkRestricted asserts a container cannot gain anything: non-root,
// read-only root, no capabilities, no escalation, the runtime's seccomp.
func checkRestricted(t testing.TB, name string, sc *corev1.SecurityContext) {
	t.Helper()
	if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot ||
		sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem ||
		sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		(sc.Privileged != nil && *sc.Privileged) ||
		sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) > 0 ||
		sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		js, _ := json.Marshal(sc)
		t.Errorf("%s: security context %s is not restricted", name, js)
	}
}

func kinds(m *Manifest) string {
	var k []string
	for kind, n := range m.Kinds() {
		k = append(k, fmt.Sprintf("%s=%d", kind, n))
	}
	sort.Strings(k)
	return strings.Join(k, ",")
}

const anonymous = "gateway: {allowAnonymousNonLoopback: true}\n"

const oidcOn = `
oidc:
  issuer: https://dex.example.com
  audiences: [muster, portal]
`

// TestTemplate renders the chart for several value sets, decodes every
// document strictly into its Kubernetes type and checks the properties the
// deployment depends on; values the chart must refuse fail rendering.
func TestTemplate(t *testing.T) {
	cases := []struct {
		name  string
		vals  string
		kinds string
		check func(t *testing.T, m *Manifest, pod *corev1.PodSpec)
	}{{
		name:  "default",
		vals:  anonymous,
		kinds: "Deployment=1,Service=1,ServiceAccount=1",
		check: func(t *testing.T, m *Manifest, pod *corev1.PodSpec) {
			d := One[appsv1.Deployment](m)
			if d.Spec.Replicas == nil || *d.Spec.Replicas != 1 || d.Spec.Strategy.Type != appsv1.RecreateDeploymentStrategyType {
				t.Errorf("deployment: replicas %v, strategy %s", d.Spec.Replicas, d.Spec.Strategy.Type)
			}
			init := Container(pod, "guest-image")
			want := []string{"/usr/local/bin/vmm-hypervisor", "image", "pull", "gsoci.azurecr.io/giantswarm/vm-manager-guest-image:0.1.0", "--image-dir=" + imageDir}
			if len(pod.InitContainers) != 1 || init == nil || !slices.Equal(init.Command, want) || len(init.Args) > 0 {
				t.Fatalf("init containers %+v, want one with command %q", pod.InitContainers, want)
			}
			if init.Image != Container(pod, "hypervisor").Image {
				t.Errorf("guest-image runs %s, not the hypervisor's image", init.Image)
			}
			checkRestricted(t, "guest-image", init.SecurityContext)
			if mnt := MountFor(init, imageDir); mnt == nil || mnt.Name != "state" {
				t.Errorf("guest-image: the image directory's mount: %+v", mnt)
			}
			hv := Container(pod, "hypervisor")
			if sc := hv.SecurityContext; sc == nil || sc.Privileged == nil || !*sc.Privileged {
				t.Errorf("hypervisor is not privileged by default: %+v", sc)
			}
			for _, a := range []string{"--default-network=default", "--network-subnet=192.168.127.0/24", "--install-timeout=5m", "--boot-timeout=4m", "--stop-timeout=30s", "--metrics-guest-series-limit=1000"} {
				if !hasArg(hv, a) {
					t.Errorf("hypervisor args %q lack %s", hv.Args, a)
				}
			}
			at := Container(pod, "attestation")
			if !hasArg(at, "--attestation=verify") || !hasArg(at, "--attestation-learn-golden=false") || !hasArg(at, "--attestation-learn-golden-acknowledge=false") {
				t.Errorf("attestation args %q", at.Args)
			}
			gw := Container(pod, "gateway")
			if !hasArg(gw, "--allow-anonymous-non-loopback") || !hasArg(gw, "--metrics-enabled=true") {
				t.Errorf("gateway args %q", gw.Args)
			}
			// The anonymous API answers the Service's names (muster's
			// MCPServer URL among them), refusing other Hosts.
			if !hasArg(gw, "--allowed-hosts=vm-manager,vm-manager.agent-platform,vm-manager.agent-platform.svc,vm-manager.agent-platform.svc.cluster.local") {
				t.Errorf("gateway args %q lack the Service's names in --allowed-hosts", gw.Args)
			}
			for _, c := range pod.Containers {
				if _, ok := env(&c)["VM_MANAGER_OIDC_ISSUER"]; ok {
					t.Errorf("%s: an OIDC issuer without oidc.issuer", c.Name)
				}
			}
			for _, v := range pod.Volumes {
				if v.Name == "state" && v.EmptyDir == nil {
					t.Errorf("state without persistence is not an emptyDir: %+v", v)
				}
			}
		},
	}, {
		name:  "daemonset",
		vals:  anonymous + "mode: daemonset\nnodeSelector: {kubernetes.io/arch: amd64}\n",
		kinds: "DaemonSet=1,Service=1,ServiceAccount=1",
		check: func(t *testing.T, m *Manifest, pod *corev1.PodSpec) {
			want := map[string]string{"vm-manager.giantswarm.io/kvm": "true", "kubernetes.io/arch": "amd64"}
			if fmt.Sprint(pod.NodeSelector) != fmt.Sprint(want) {
				t.Errorf("nodeSelector %v, want %v", pod.NodeSelector, want)
			}
			ds := One[appsv1.DaemonSet](m)
			if ru := ds.Spec.UpdateStrategy.RollingUpdate; ru == nil || ru.MaxSurge == nil || ru.MaxSurge.IntValue() != 0 {
				t.Errorf("daemonset update strategy %+v", ds.Spec.UpdateStrategy)
			}
		},
	}, {
		name:  "persistence.create",
		vals:  oidcOn + "persistence: {create: true, size: 20Gi, storageClass: local-path, accessModes: [ReadWriteOncePod]}\n",
		kinds: "Deployment=1,PersistentVolumeClaim=1,Service=1,ServiceAccount=1",
		check: func(t *testing.T, m *Manifest, pod *corev1.PodSpec) {
			pvc := One[corev1.PersistentVolumeClaim](m)
			if q := pvc.Spec.Resources.Requests[corev1.ResourceStorage]; q.String() != "20Gi" ||
				pvc.Spec.StorageClassName == nil || *pvc.Spec.StorageClassName != "local-path" ||
				!slices.Equal(pvc.Spec.AccessModes, []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOncePod}) ||
				pvc.Annotations["helm.sh/resource-policy"] != "keep" {
				t.Errorf("pvc %+v", pvc)
			}
			for _, v := range pod.Volumes {
				if v.Name == "state" && (v.PersistentVolumeClaim == nil || v.PersistentVolumeClaim.ClaimName != pvc.Name) {
					t.Errorf("state volume %+v, want claim %s", v, pvc.Name)
				}
			}
		},
	}, {
		name:  "persistence.create without provisioning",
		vals:  anonymous + "persistence: {create: true, storageClass: '-'}\n",
		kinds: "Deployment=1,PersistentVolumeClaim=1,Service=1,ServiceAccount=1",
		check: func(t *testing.T, m *Manifest, pod *corev1.PodSpec) {
			pvc := One[corev1.PersistentVolumeClaim](m)
			if q := pvc.Spec.Resources.Requests[corev1.ResourceStorage]; q.String() != "50Gi" || pvc.Spec.StorageClassName == nil || *pvc.Spec.StorageClassName != "" ||
				!slices.Equal(pvc.Spec.AccessModes, []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}) {
				t.Errorf("pvc %+v", pvc.Spec)
			}
		},
	}, {
		name:  "persistence.existingClaim",
		vals:  anonymous + "persistence: {existingClaim: lab-state}\n",
		kinds: "Deployment=1,Service=1,ServiceAccount=1",
		check: func(t *testing.T, m *Manifest, pod *corev1.PodSpec) {
			for _, v := range pod.Volumes {
				if v.Name == "state" && (v.PersistentVolumeClaim == nil || v.PersistentVolumeClaim.ClaimName != "lab-state") {
					t.Errorf("state volume %+v, want claim lab-state", v)
				}
			}
		},
	}, {
		name: "muster+serviceMonitor+networkPolicy",
		vals: oidcOn + `
muster: {mcpServer: {enabled: true, labels: {example.com/owner: lab}, auth: {requiredAudiences: [portal]}}}
serviceMonitor: {enabled: true, interval: 15s, labels: {release: prometheus}}
networkPolicy: {enabled: true, ingressNamespaces: [muster, monitoring]}
`,
		kinds: "Deployment=1,MCPServer=1,NetworkPolicy=1,Service=1,ServiceAccount=1,ServiceMonitor=1",
		check: func(t *testing.T, m *Manifest, pod *corev1.PodSpec) {
			s := One[MCPServer](m)
			if s.APIVersion != "muster.giantswarm.io/v1alpha1" || s.Name != "vm-manager" || s.Namespace != Namespace ||
				s.Labels["agent-platform.giantswarm.io/tool-group"] != "agent-platform" ||
				s.Labels["muster.giantswarm.io/type"] != "vm-manager" || s.Labels["example.com/owner"] != "lab" {
				t.Errorf("mcpserver metadata %+v", s.ObjectMeta)
			}
			if s.Spec.Type != "streamable-http" || s.Spec.URL != "http://vm-manager.agent-platform.svc:8080/mcp" || !s.Spec.AutoStart || s.Spec.Description == "" {
				t.Errorf("mcpserver spec %+v", s.Spec)
			}
			if a := s.Spec.Auth; a == nil || a.Type != "oauth" || !a.ForwardToken || !slices.Equal(a.RequiredAudiences, []string{"portal"}) {
				t.Errorf("mcpserver auth %+v", a)
			}
			sm := One[ServiceMonitor](m)
			if sm.Labels["release"] != "prometheus" || len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != "http" ||
				sm.Spec.Endpoints[0].Path != "/metrics" || sm.Spec.Endpoints[0].Interval != "15s" ||
				fmt.Sprint(sm.Spec.Selector.MatchLabels) != fmt.Sprint(One[corev1.Service](m).Spec.Selector) {
				t.Errorf("servicemonitor %+v", sm)
			}
			np := One[networkingv1.NetworkPolicy](m)
			if len(np.Spec.Ingress) != 1 || len(np.Spec.Ingress[0].Ports) != 1 || np.Spec.Ingress[0].Ports[0].Port.String() != "http" {
				t.Fatalf("networkpolicy ingress %+v", np.Spec.Ingress)
			}
			from := np.Spec.Ingress[0].From
			if len(from) != 2 || from[1].NamespaceSelector == nil || !slices.Equal(from[1].NamespaceSelector.MatchExpressions[0].Values, []string{"muster", "monitoring"}) {
				t.Errorf("networkpolicy from %+v", from)
			}
			if len(np.Spec.Egress) != 1 || len(np.Spec.Egress[0].To) != 0 || len(np.Spec.Egress[0].Ports) != 0 {
				t.Errorf("guest egress: want one allow-all rule, got %+v", np.Spec.Egress)
			}
		},
	}, {
		name:  "networkPolicy without guest egress, MCPServer of an anonymous server",
		vals:  anonymous + "networkPolicy: {enabled: true, guestEgress: false, egressPorts: [443, 5000]}\nmuster: {mcpServer: {enabled: true}}\n",
		kinds: "Deployment=1,MCPServer=1,NetworkPolicy=1,Service=1,ServiceAccount=1",
		check: func(t *testing.T, m *Manifest, pod *corev1.PodSpec) {
			np := One[networkingv1.NetworkPolicy](m)
			var ports []string
			for _, r := range np.Spec.Egress {
				for _, p := range r.Ports {
					ports = append(ports, fmt.Sprintf("%s/%s", p.Port, *p.Protocol))
				}
			}
			if want := []string{"53/UDP", "53/TCP", "443/TCP", "5000/TCP"}; !slices.Equal(ports, want) {
				t.Errorf("egress ports %v, want %v", ports, want)
			}
			if a := One[MCPServer](m).Spec.Auth; a != nil {
				t.Errorf("an anonymous vm-manager's MCPServer has auth %+v", a)
			}
		},
	}, {
		name: "OIDC on",
		// The anonymous opt-in is ignored with an issuer.
		vals:  anonymous + "oidc: {issuer: https://dex.example.com, audiences: [muster, portal], caSecret: {name: dex-ca, key: ca.pem}}\n",
		kinds: "Deployment=1,Service=1,ServiceAccount=1",
		check: func(t *testing.T, m *Manifest, pod *corev1.PodSpec) {
			for _, c := range pod.Containers {
				e := env(&c)
				if e["VM_MANAGER_OIDC_ISSUER"] != "https://dex.example.com" || e["VM_MANAGER_OIDC_AUDIENCES"] != "muster,portal" {
					t.Errorf("%s: OIDC env %v", c.Name, e)
				}
				if e["SSL_CERT_FILE"] != "/etc/vm-manager/oidc-ca/ca.pem" {
					t.Errorf("%s: SSL_CERT_FILE=%q", c.Name, e["SSL_CERT_FILE"])
				}
				if mnt := MountFor(&c, e["SSL_CERT_FILE"]); mnt == nil || mnt.Name != "oidc-ca" || !mnt.ReadOnly {
					t.Errorf("%s: the CA's mount %+v", c.Name, mnt)
				}
			}
			if gw := Container(pod, "gateway"); hasArg(gw, "--allow-anonymous-non-loopback") || slices.ContainsFunc(gw.Args, func(a string) bool { return strings.HasPrefix(a, "--allowed-hosts") }) {
				t.Errorf("the gateway allows anonymous non-loopback (or lists hosts) with an issuer: %q", gw.Args)
			}
			for _, v := range pod.Volumes {
				if v.Name == "oidc-ca" && (v.Secret == nil || v.Secret.SecretName != "dex-ca" || v.Secret.Items[0].Key != "ca.pem") {
					t.Errorf("oidc-ca volume %+v", v)
				}
			}
		},
	}, {
		name:  "guest image by digest over plain HTTP with credentials",
		vals:  anonymous + "guestImage: {registry: 'kind-registry:5000', repository: vm-manager-guest-image, digest: 'sha256:" + strings.Repeat("ab", 32) + "', plainHTTP: true, pullSecret: lab-registry}\n",
		kinds: "Deployment=1,Service=1,ServiceAccount=1",
		check: func(t *testing.T, m *Manifest, pod *corev1.PodSpec) {
			init := Container(pod, "guest-image")
			want := []string{"/usr/local/bin/vmm-hypervisor", "image", "pull", "kind-registry:5000/vm-manager-guest-image@sha256:" + strings.Repeat("ab", 32), "--image-dir=" + imageDir, "--plain-http"}
			if !slices.Equal(init.Command, want) {
				t.Errorf("guest-image command %q, want %q", init.Command, want)
			}
			if d := env(init)["DOCKER_CONFIG"]; d == "" || MountFor(init, d+"/config.json") == nil || MountFor(init, d+"/config.json").Name != "registry-auth" {
				t.Errorf("guest-image registry credentials: DOCKER_CONFIG=%q, mounts %+v", d, init.VolumeMounts)
			}
		},
	}, {
		name:  "guest image off",
		vals:  anonymous + "guestImage: {enabled: false}\n",
		kinds: "Deployment=1,Service=1,ServiceAccount=1",
		check: func(t *testing.T, m *Manifest, pod *corev1.PodSpec) {
			if len(pod.InitContainers) != 0 {
				t.Errorf("init containers %+v", pod.InitContainers)
			}
		},
	}, {
		name:  "unprivileged hypervisor",
		vals:  anonymous + "hypervisor: {privileged: false}\n",
		kinds: "Deployment=1,Service=1,ServiceAccount=1",
		check: func(t *testing.T, m *Manifest, pod *corev1.PodSpec) {
			hv := Container(pod, "hypervisor")
			checkRestricted(t, "hypervisor", hv.SecurityContext)
			for _, r := range []corev1.ResourceName{"devices.kubevirt.io/kvm", "devices.kubevirt.io/vhost-vsock", "devices.kubevirt.io/tun"} {
				if q, ok := hv.Resources.Limits[r]; !ok || q.String() != "1" {
					t.Errorf("hypervisor limits %v lack %s", hv.Resources.Limits, r)
				}
			}
			if q := hv.Resources.Requests[corev1.ResourceCPU]; q.String() != "250m" {
				t.Errorf("hypervisor requests %v", hv.Resources.Requests)
			}
		},
	}, {
		name:  "extraArgs, extraEnv, a parent chart's globals",
		vals:  "global: {identity: {issuer: https://dex.example.com}}\nhypervisor: {extraArgs: [--notify-port=4000], extraEnv: [{name: A, value: b}]}\ngateway: {allowAnonymousNonLoopback: true, allowedHosts: [vmm.lab.example, 'localhost:9000'], extraArgs: ['--log-level=debug']}\n",
		kinds: "Deployment=1,Service=1,ServiceAccount=1",
		check: func(t *testing.T, m *Manifest, pod *corev1.PodSpec) {
			hv := Container(pod, "hypervisor")
			if hv.Args[len(hv.Args)-1] != "--notify-port=4000" || env(hv)["A"] != "b" {
				t.Errorf("hypervisor args %q env %v", hv.Args, hv.Env)
			}
			gw := Container(pod, "gateway")
			if gw.Args[len(gw.Args)-1] != "--log-level=debug" || !slices.ContainsFunc(gw.Args, func(a string) bool {
				return strings.HasPrefix(a, "--allowed-hosts=vm-manager,") && strings.HasSuffix(a, ".svc.cluster.local,vmm.lab.example,localhost:9000")
			}) {
				t.Errorf("gateway args %q", gw.Args)
			}
		},
	}}
	files := ciValues(t)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		cases = append(cases, struct {
			name  string
			vals  string
			kinds string
			check func(t *testing.T, m *Manifest, pod *corev1.PodSpec)
		}{name: "ci/" + filepath.Base(f), vals: string(b)})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m, manifest := render(t, values(t, tc.vals))
			if tc.kinds != "" && kinds(m) != tc.kinds {
				t.Errorf("kinds %s, want %s", kinds(m), tc.kinds)
			}
			tpl := checkPod(t, m, manifest)
			if tc.check != nil {
				tc.check(t, m, &tpl.Spec)
			}
		})
	}

	refused := []struct{ name, vals, want string }{
		{"the defaults: anonymous without the opt-in", "", "the API is anonymous without oidc.issuer. Set oidc.issuer and oidc.audiences"},
		{"an unknown value", anonymous + "replicaCount: 2\n", "additional properties 'replicaCount' not allowed"},
		{"an unknown nested value", anonymous + "vm: {bogus: true}\n", "at '/vm': additional properties 'bogus' not allowed"},
		{"an unknown value deep down", anonymous + "muster: {mcpServer: {auth: {type: none}}}\n", "at '/muster/mcpServer/auth': additional properties 'type' not allowed"},
		{"a bad mode", anonymous + "mode: statefulset\n", "at '/mode': value must be one of 'deployment', 'daemonset', 'fleet'"},
		{"a bad attestation mode", anonymous + "vm: {attestation: maybe}\n", "at '/vm/attestation': value must be one of 'verify', 'noop'"},
		{"a bad duration", anonymous + "vm: {bootTimeout: 4 minutes}\n", "at '/vm/bootTimeout'"},
		{"a bad CIDR", anonymous + "vm: {networkSubnet: 192.168.127.0}\n", "at '/vm/networkSubnet'"},
		{"a bad type", anonymous + "metrics: {enabled: 'yes'}\n", "at '/metrics/enabled': got string, want boolean"},
		{"a guest series limit of 0", anonymous + "metrics: {guestSeriesLimit: 0}\n", "at '/metrics/guestSeriesLimit'"},
		{"a bad digest", anonymous + "guestImage: {digest: latest}\n", "at '/guestImage/digest'"},
		{"root", anonymous + "podSecurityContext: {runAsUser: 0, runAsGroup: 0, fsGroup: 0}\n", "at '/podSecurityContext/runAsUser'"},
		{"an issuer without audiences", "oidc: {issuer: https://dex.example.com}\n", "oidc.issuer needs at least one entry in oidc.audiences"},
		{"a CA without an issuer", anonymous + "oidc: {caSecret: {name: dex-ca}}\n", "oidc.caSecret.name is set but oidc.issuer is empty"},
		{"a ServiceMonitor without metrics", anonymous + "metrics: {enabled: false}\nserviceMonitor: {enabled: true}\n", "serviceMonitor.enabled needs metrics.enabled"},
		{"learn mode without verify", anonymous + "vm: {attestation: noop, learnGolden: true, learnGoldenAcknowledge: true}\n", "vm.learnGolden needs vm.attestation=verify"},
		{"learn mode without its acknowledgement", anonymous + "vm: {learnGolden: true}\n", "set vm.learnGoldenAcknowledge=true"},
		{"a DaemonSet with a claim", anonymous + "mode: daemonset\npersistence: {create: true}\n", "mode=daemonset keeps each node's state in an emptyDir"},
		{"two claims", anonymous + "persistence: {create: true, existingClaim: x}\n", "set persistence.create or persistence.existingClaim, not both"},
		{"unprivileged without devices", anonymous + "hypervisor: {privileged: false, deviceResources: null}\n", "hypervisor.privileged=false needs hypervisor.deviceResources"},
	}
	for _, tc := range refused {
		t.Run("refuses "+tc.name, func(t *testing.T) {
			_, err := Render(ChartDir, values(t, tc.vals))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("render: %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// TestSchemaCoversValues walks values.yaml: every key has a schema entry, and
// every object the schema declares with properties refuses unknown keys.
func TestSchemaCoversValues(t *testing.T) {
	vals, err := chartutil.ReadValuesFile(filepath.Join(ChartDir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(ChartDir, "values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	var schema map[string]any
	if err := json.Unmarshal(b, &schema); err != nil {
		t.Fatal(err)
	}
	var walk func(path string, v any, s map[string]any)
	walk = func(path string, v any, s map[string]any) {
		if s == nil {
			t.Errorf("%s: no schema", path)
			return
		}
		props, hasProps := s["properties"].(map[string]any)
		if hasProps && s["additionalProperties"] != false {
			t.Errorf("%s: the schema allows unknown keys", path)
		}
		m, isMap := v.(map[string]any)
		if !isMap {
			if _, ok := s["type"]; !ok {
				t.Errorf("%s: the schema has no type", path)
			}
			return
		}
		if !hasProps {
			if _, ok := s["additionalProperties"].(map[string]any); !ok && path != "" {
				t.Errorf("%s: a map whose values the schema does not describe", path)
			}
			return
		}
		for k, sub := range m {
			ps, _ := props[k].(map[string]any)
			walk(path+"."+k, sub, ps)
		}
	}
	walk("", map[string]any(vals), schema)
}
