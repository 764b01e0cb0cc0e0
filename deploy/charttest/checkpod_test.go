package charttest

import (
	"fmt"
	"runtime"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

// recorder is a testing.TB that keeps the failures of the check it is given.
type recorder struct {
	testing.TB
	failures []string
}

func (r *recorder) Helper() {}
func (r *recorder) Errorf(format string, args ...any) {
	r.failures = append(r.failures, fmt.Sprintf(format, args...))
}
func (r *recorder) Fatalf(format string, args ...any) { r.Errorf(format, args...); runtime.Goexit() }
func (r *recorder) Fatal(args ...any)                 { r.Errorf("%s", fmt.Sprint(args...)); runtime.Goexit() }

// runCheckPod runs checkPod on its own goroutine (a Fatal ends it) and
// returns what it reported.
func runCheckPod(t *testing.T, m *Manifest, manifest string) []string {
	r := &recorder{TB: t}
	done := make(chan struct{})
	go func() { defer close(done); checkPod(r, m, manifest) }()
	<-done
	return r.failures
}

// The pod checks every rendering goes through must be able to fail: each
// breach a template change could bring (a hostPath, a privileged sidecar, the
// state where it does not belong, ...) is planted in a rendering of the
// defaults and must be reported.
func TestCheckPodCatches(t *testing.T) {
	m, manifest := render(t, values(t, anonymous))
	if got := runCheckPod(t, m, manifest); len(got) != 0 {
		t.Fatalf("the defaults fail the pod checks: %q", got)
	}
	for _, tc := range []struct {
		name, want string
		plant      func(pod *corev1.PodSpec) (manifestExtra string)
	}{
		{"a hostPath run volume", "volume run is a hostPath", func(pod *corev1.PodSpec) string {
			for i := range pod.Volumes {
				if pod.Volumes[i].Name == "run" {
					pod.Volumes[i].VolumeSource = corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/run/vm-manager"}}
				}
			}
			return ""
		}},
		{"hostPath anywhere in the manifest", "the manifest mentions hostPath", func(*corev1.PodSpec) string {
			return "\n---\n# hostPath: /var/lib/kubelet\n"
		}},
		{"a privileged attestation container", "attestation: security context", func(pod *corev1.PodSpec) string {
			yes := true
			Container(pod, "attestation").SecurityContext.Privileged = &yes
			return ""
		}},
		{"a gateway with added capabilities", "gateway: security context", func(pod *corev1.PodSpec) string {
			Container(pod, "gateway").SecurityContext.Capabilities.Add = []corev1.Capability{"NET_ADMIN"}
			return ""
		}},
		{"the state mounted in the gateway", "the gateway mounts the state", func(pod *corev1.PodSpec) string {
			gw := Container(pod, "gateway")
			gw.VolumeMounts = append(gw.VolumeMounts, corev1.VolumeMount{Name: "state", MountPath: stateDir})
			return ""
		}},
		{"a service account token", "automountServiceAccountToken", func(pod *corev1.PodSpec) string {
			yes := true
			pod.AutomountServiceAccountToken = &yes
			return ""
		}},
		{"a pod running as root", "pod security context", func(pod *corev1.PodSpec) string {
			root := int64(0)
			pod.SecurityContext.RunAsUser = &root
			return ""
		}},
		{"a hypervisor that leaves VMs behind", "--detach-vms-on-exit=false", func(pod *corev1.PodSpec) string {
			hv := Container(pod, "hypervisor")
			for i, a := range hv.Args {
				if a == "--detach-vms-on-exit=false" {
					hv.Args[i] = "--detach-vms-on-exit=true"
				}
			}
			return ""
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, manifest := render(t, values(t, anonymous))
			tpl, err := m.PodSpec()
			if err != nil {
				t.Fatal(err)
			}
			extra := tc.plant(&tpl.Spec)
			got := runCheckPod(t, m, manifest+extra)
			if !strings.Contains(strings.Join(got, "\n"), tc.want) {
				t.Errorf("checkPod reported %q, want a failure naming %q", got, tc.want)
			}
		})
	}
}
