// Package charttest checks the Helm chart in deploy/helm/vm-manager with Helm's
// own Go library: lint, render, decode every rendered document strictly into
// its Kubernetes type, and run the rendered pod's three containers as local
// processes (the tests in this module).
package charttest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"path/filepath"
	"regexp"
	"strings"

	"helm.sh/helm/v3/pkg/action"
	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/release"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// ChartDir is the chart, relative to this module's directory.
const ChartDir = "../helm/vm-manager"

// Release name, namespace and Kubernetes version of every render and lint.
// Helm's library defaults to Kubernetes v1.20 (the helm binary has its
// version set at build time); the chart needs 1.25 or later.
const (
	ReleaseName = "vm-manager"
	Namespace   = "agent-platform"
	KubeVersion = "v1.33.0"
)

// Render renders the chart like `helm template` (an install that is a client
// only dry run, CRDs included) with vals over the chart's values.yaml.
func Render(chartDir string, vals map[string]any) (*release.Release, error) {
	ch, err := loader.Load(chartDir)
	if err != nil {
		return nil, err
	}
	cfg := &action.Configuration{Log: func(string, ...any) {}}
	install := action.NewInstall(cfg)
	install.DryRun = true
	install.ClientOnly = true
	install.Replace = true
	install.IncludeCRDs = true
	install.ReleaseName = ReleaseName
	install.Namespace = Namespace
	kv, err := chartutil.ParseKubeVersion(KubeVersion)
	if err != nil {
		return nil, err
	}
	install.KubeVersion = kv
	if vals == nil {
		vals = map[string]any{}
	}
	return install.Run(ch, vals)
}

// ServiceMonitor is the part of monitoring.coreos.com/v1 ServiceMonitor the
// chart renders; decoding rejects any other field.
type ServiceMonitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Selector          metav1.LabelSelector `json:"selector"`
		NamespaceSelector struct {
			MatchNames []string `json:"matchNames"`
		} `json:"namespaceSelector"`
		Endpoints []struct {
			Port          string `json:"port"`
			Path          string `json:"path"`
			Scheme        string `json:"scheme"`
			Interval      string `json:"interval"`
			ScrapeTimeout string `json:"scrapeTimeout"`
		} `json:"endpoints"`
	} `json:"spec"`
}

// MCPServer is muster.giantswarm.io/v1alpha1 MCPServer as far as the chart
// renders it; decoding rejects any other field.
type MCPServer struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Type        string `json:"type"`
		URL         string `json:"url"`
		AutoStart   bool   `json:"autoStart"`
		Description string `json:"description"`
		Auth        *struct {
			Type              string   `json:"type"`
			ForwardToken      bool     `json:"forwardToken"`
			RequiredAudiences []string `json:"requiredAudiences,omitempty"`
		} `json:"auth,omitempty"`
	} `json:"spec"`
}

// Certificate is cert-manager.io/v1 Certificate as far as the chart renders
// it; decoding rejects any other field.
type Certificate struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		SecretName  string   `json:"secretName"`
		DNSNames    []string `json:"dnsNames"`
		Duration    string   `json:"duration"`
		RenewBefore string   `json:"renewBefore"`
		PrivateKey  struct {
			Algorithm      string `json:"algorithm"`
			Size           int    `json:"size"`
			RotationPolicy string `json:"rotationPolicy"`
		} `json:"privateKey"`
		Usages    []string `json:"usages"`
		IssuerRef struct {
			Name  string `json:"name"`
			Kind  string `json:"kind"`
			Group string `json:"group"`
		} `json:"issuerRef"`
	} `json:"spec"`
}

// Manifest is a rendered release, decoded.
type Manifest struct {
	Docs []Doc
}

// Doc is one rendered document: its source template, kind and typed object.
type Doc struct {
	Source string // "vm-manager/templates/deployment.yaml"
	Kind   string
	Name   string
	Object any // *appsv1.Deployment, *corev1.Service, … *MCPServer
}

// newObject returns the Go type a kind decodes into.
func newObject(apiVersion, kind string) (any, error) {
	switch apiVersion + "/" + kind {
	case "apps/v1/Deployment":
		return &appsv1.Deployment{}, nil
	case "apps/v1/DaemonSet":
		return &appsv1.DaemonSet{}, nil
	case "apps/v1/StatefulSet":
		return &appsv1.StatefulSet{}, nil
	case "rbac.authorization.k8s.io/v1/Role":
		return &rbacv1.Role{}, nil
	case "rbac.authorization.k8s.io/v1/RoleBinding":
		return &rbacv1.RoleBinding{}, nil
	case "cert-manager.io/v1/Certificate":
		return &Certificate{}, nil
	case "v1/Service":
		return &corev1.Service{}, nil
	case "v1/ServiceAccount":
		return &corev1.ServiceAccount{}, nil
	case "v1/PersistentVolumeClaim":
		return &corev1.PersistentVolumeClaim{}, nil
	case "v1/Secret":
		return &corev1.Secret{}, nil
	case "networking.k8s.io/v1/NetworkPolicy":
		return &networkingv1.NetworkPolicy{}, nil
	case "monitoring.coreos.com/v1/ServiceMonitor":
		return &ServiceMonitor{}, nil
	case "muster.giantswarm.io/v1alpha1/MCPServer":
		return &MCPServer{}, nil
	}
	return nil, fmt.Errorf("no Go type for %s %s", apiVersion, kind)
}

var sourceLine = regexp.MustCompile(`(?m)^# Source: (.+)$`)

// Decode splits a manifest into its documents and decodes each strictly:
// YAML to JSON refusing duplicate keys, then JSON into the kind's Go type
// refusing unknown fields. An empty document is skipped; anything that does
// not decode is an error.
func Decode(manifest string) (*Manifest, error) {
	m := &Manifest{}
	for _, doc := range splitDocs(manifest) {
		source := ""
		if s := sourceLine.FindStringSubmatch(doc); s != nil {
			source = s[1]
		}
		js, err := yaml.YAMLToJSONStrict([]byte(doc))
		if err != nil {
			return nil, fmt.Errorf("%s: %w", source, err)
		}
		if bytes.Equal(bytes.TrimSpace(js), []byte("null")) {
			continue
		}
		var tm metav1.TypeMeta
		if err := json.Unmarshal(js, &tm); err != nil {
			return nil, fmt.Errorf("%s: %w", source, err)
		}
		obj, err := newObject(tm.APIVersion, tm.Kind)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", source, err)
		}
		dec := json.NewDecoder(bytes.NewReader(js))
		dec.DisallowUnknownFields()
		if err := dec.Decode(obj); err != nil {
			return nil, fmt.Errorf("%s (%s): %w", source, tm.Kind, err)
		}
		name := ""
		if o, ok := obj.(metav1.Object); ok {
			name = o.GetName()
		}
		m.Docs = append(m.Docs, Doc{Source: source, Kind: tm.Kind, Name: name, Object: obj})
	}
	return m, nil
}

// splitDocs splits a multi-document YAML stream at its "---" lines.
func splitDocs(s string) []string {
	var docs []string
	var cur []string
	for _, line := range strings.Split(s, "\n") {
		if strings.TrimRight(line, " ") == "---" {
			docs = append(docs, strings.Join(cur, "\n"))
			cur = nil
			continue
		}
		cur = append(cur, line)
	}
	docs = append(docs, strings.Join(cur, "\n"))
	var out []string
	for _, d := range docs {
		if strings.TrimSpace(d) != "" {
			out = append(out, d)
		}
	}
	return out
}

// Kinds counts the documents per kind.
func (m *Manifest) Kinds() map[string]int {
	k := map[string]int{}
	for _, d := range m.Docs {
		k[d.Kind]++
	}
	return k
}

// All returns the documents of one kind.
func All[T any](m *Manifest) []*T {
	var out []*T
	for _, d := range m.Docs {
		if o, ok := d.Object.(*T); ok {
			out = append(out, o)
		}
	}
	return out
}

// One returns the only document of one kind, or nil when there is not exactly one.
func One[T any](m *Manifest) *T {
	all := All[T](m)
	if len(all) != 1 {
		return nil
	}
	return all[0]
}

// PodSpec returns the pod template of the Deployment or DaemonSet, or in
// fleet mode the node pods' (the StatefulSet's; see FleetGateway for the
// fleet gateway's Deployment).
func (m *Manifest) PodSpec() (*corev1.PodTemplateSpec, error) {
	deps, dss := All[appsv1.Deployment](m), All[appsv1.DaemonSet](m)
	if sts := All[appsv1.StatefulSet](m); len(sts) > 0 {
		if len(sts) != 1 || len(dss) != 0 || len(deps) != 1 {
			return nil, fmt.Errorf("fleet: want one StatefulSet and one Deployment, got %d, %d (and %d DaemonSets)", len(sts), len(deps), len(dss))
		}
		return &sts[0].Spec.Template, nil
	}
	switch {
	case len(deps) == 1 && len(dss) == 0:
		return &deps[0].Spec.Template, nil
	case len(dss) == 1 && len(deps) == 0:
		return &dss[0].Spec.Template, nil
	}
	return nil, fmt.Errorf("want one Deployment or one DaemonSet, got %d and %d", len(deps), len(dss))
}

// Service returns the Service of that name, or nil.
func (m *Manifest) Service(name string) *corev1.Service {
	for _, s := range All[corev1.Service](m) {
		if s.Name == name {
			return s
		}
	}
	return nil
}

// Container returns the container (or init container) of a pod by name.
func Container(pod *corev1.PodSpec, name string) *corev1.Container {
	for i := range pod.Containers {
		if pod.Containers[i].Name == name {
			return &pod.Containers[i]
		}
	}
	for i := range pod.InitContainers {
		if pod.InitContainers[i].Name == name {
			return &pod.InitContainers[i]
		}
	}
	return nil
}

// MountFor returns the volume mount of c whose mount path holds path (the
// longest such), or nil.
func MountFor(c *corev1.Container, path string) *corev1.VolumeMount {
	var best *corev1.VolumeMount
	for i := range c.VolumeMounts {
		vm := &c.VolumeMounts[i]
		rel, err := filepath.Rel(vm.MountPath, path)
		if err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
			continue
		}
		if best == nil || len(vm.MountPath) > len(best.MountPath) {
			best = vm
		}
	}
	return best
}
