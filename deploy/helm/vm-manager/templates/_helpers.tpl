{{/* Paths inside the pod. The run directory is created by the processes themselves
(0700, owned by the pod's UID) inside the shared emptyDir mounted at its parent. */}}
{{- define "vm-manager.stateDir" -}}/var/lib/vm-manager{{- end }}
{{- define "vm-manager.imageDir" -}}/var/lib/vm-manager/images{{- end }}
{{- define "vm-manager.runDir" -}}/run/vm-manager{{- end }}
{{- define "vm-manager.runMount" -}}/run{{- end }}
{{- define "vm-manager.caDir" -}}/etc/vm-manager/oidc-ca{{- end }}
{{- define "vm-manager.dockerConfigDir" -}}/etc/vm-manager/registry{{- end }}
{{- define "vm-manager.tlsDir" -}}/etc/vm-manager/tls{{- end }}
{{- define "vm-manager.fleetCADir" -}}/etc/vm-manager/fleet-ca{{- end }}

{{- define "vm-manager.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "vm-manager.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* mode=fleet: the node pods' StatefulSet and headless Service, the fleet gateway's
Deployment and ServiceAccount, and the node gateways' TLS Secret. */}}
{{- define "vm-manager.nodesName" -}}{{ printf "%s-node" (include "vm-manager.fullname" .) | trunc 52 | trimSuffix "-" }}{{- end }}
{{- define "vm-manager.nodesService" -}}{{ printf "%s-nodes" (include "vm-manager.fullname" .) | trunc 63 | trimSuffix "-" }}{{- end }}
{{- define "vm-manager.fleetName" -}}{{ printf "%s-fleet" (include "vm-manager.fullname" .) | trunc 63 | trimSuffix "-" }}{{- end }}
{{- define "vm-manager.tlsSecret" -}}{{ default (printf "%s-nodes-tls" (include "vm-manager.fullname" .)) .Values.fleet.tls.secretName }}{{- end }}
{{- define "vm-manager.nodesDomain" -}}{{ printf "%s.%s.svc" (include "vm-manager.nodesService" .) .Release.Namespace }}{{- end }}

{{/* Pod labels: in fleet mode the node pods and the fleet gateway's are told apart by
component (the other modes' selectors stay as they were: they are immutable). */}}
{{- define "vm-manager.nodeSelectorLabels" -}}
{{ include "vm-manager.selectorLabels" . }}
{{- if eq .Values.mode "fleet" }}
app.kubernetes.io/component: node
{{- end }}
{{- end }}

{{- define "vm-manager.fleetSelectorLabels" -}}
{{ include "vm-manager.selectorLabels" . }}
app.kubernetes.io/component: fleet-gateway
{{- end }}

{{- define "vm-manager.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "vm-manager.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vm-manager.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "vm-manager.labels" -}}
helm.sh/chart: {{ include "vm-manager.chart" . }}
{{ include "vm-manager.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "vm-manager.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "vm-manager.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image of one component: <registry>/<repository>-<component>:<tag>. */}}
{{- define "vm-manager.image" -}}
{{- $v := .root.Values.image -}}
{{- printf "%s/%s-%s:%s" $v.registry $v.repository .component (default .root.Chart.AppVersion $v.tag) }}
{{- end }}

{{/* The guest image reference: by digest when one is set, else by tag. */}}
{{- define "vm-manager.guestImageRef" -}}
{{- $g := .Values.guestImage -}}
{{- if $g.digest }}
{{- printf "%s/%s@%s" $g.registry $g.repository $g.digest }}
{{- else }}
{{- printf "%s/%s:%s" $g.registry $g.repository (default .Chart.AppVersion $g.tag) }}
{{- end }}
{{- end }}

{{- define "vm-manager.claimName" -}}
{{- if .Values.persistence.existingClaim }}
{{- .Values.persistence.existingClaim }}
{{- else }}
{{- printf "%s-state" (include "vm-manager.fullname" .) }}
{{- end }}
{{- end }}

{{/* Combinations the schema cannot express; each fails rendering with the fix. */}}
{{- define "vm-manager.validate" -}}
{{- $v := .Values -}}
{{- if and (not $v.oidc.issuer) (not $v.gateway.allowAnonymousNonLoopback) }}
{{- fail "vm-manager: the gateway listens on :8080 and the API is anonymous without oidc.issuer. Set oidc.issuer and oidc.audiences (callers then need an id_token of that issuer), or set gateway.allowAnonymousNonLoopback=true to serve the anonymous API to anyone who reaches the pod." }}
{{- end }}
{{- if and $v.oidc.issuer (not $v.oidc.audiences) }}
{{- fail "vm-manager: oidc.issuer needs at least one entry in oidc.audiences (the token audiences to trust, e.g. muster's client id)." }}
{{- end }}
{{- if and $v.oidc.caSecret.name (not $v.oidc.issuer) }}
{{- fail "vm-manager: oidc.caSecret.name is set but oidc.issuer is empty: the CA is only used to reach the issuer." }}
{{- end }}
{{- if and $v.vm.learnGolden (ne $v.vm.attestation "verify") }}
{{- fail "vm-manager: vm.learnGolden needs vm.attestation=verify." }}
{{- end }}
{{- if and $v.vm.learnGolden (not $v.vm.learnGoldenAcknowledge) }}
{{- fail "vm-manager: vm.learnGolden releases user-data to boots nobody has vouched for; set vm.learnGoldenAcknowledge=true as well to confirm." }}
{{- end }}
{{- if and $v.serviceMonitor.enabled (not $v.metrics.enabled) }}
{{- fail "vm-manager: serviceMonitor.enabled needs metrics.enabled (the gateway serves /metrics only then)." }}
{{- end }}
{{- if and $v.persistence.create $v.persistence.existingClaim }}
{{- fail "vm-manager: set persistence.create or persistence.existingClaim, not both." }}
{{- end }}
{{- if and (eq $v.mode "daemonset") (or $v.persistence.create $v.persistence.existingClaim) }}
{{- fail "vm-manager: mode=daemonset keeps each node's state in an emptyDir (a claim cannot be shared by the pods of a DaemonSet, and nothing is mounted from the node); unset persistence.create and persistence.existingClaim, or use mode=deployment." }}
{{- end }}
{{- if and (eq $v.mode "fleet") (or $v.persistence.create $v.persistence.existingClaim) }}
{{- fail "vm-manager: mode=fleet gives each node pod its own claim from fleet.storage (a volumeClaimTemplate); unset persistence.create and persistence.existingClaim." }}
{{- end }}
{{- if and (eq $v.mode "fleet") (not $v.fleet.tls.secretName) (not $v.fleet.tls.certManager.enabled) }}
{{- fail "vm-manager: mode=fleet needs the node gateways' TLS: set fleet.tls.secretName (a Secret with tls.crt, tls.key and ca.crt for *.<release>-nodes.<namespace>.svc) or fleet.tls.certManager.enabled with fleet.tls.certManager.issuerRef.name." }}
{{- end }}
{{- if and (eq $v.mode "fleet") $v.fleet.tls.certManager.enabled (not $v.fleet.tls.certManager.issuerRef.name) }}
{{- fail "vm-manager: fleet.tls.certManager.enabled needs fleet.tls.certManager.issuerRef.name (the cert-manager Issuer or ClusterIssuer that signs the node gateways' certificates)." }}
{{- end }}
{{- if and (not $v.hypervisor.privileged) (not $v.hypervisor.deviceResources) }}
{{- fail "vm-manager: hypervisor.privileged=false needs hypervisor.deviceResources (the device plugin resources that hand the container /dev/kvm, /dev/vhost-vsock and /dev/net/tun)." }}
{{- end }}
{{- end }}

{{/* Settings every process reads from its environment (so commands run with kubectl
exec in a container find the same directories and identity). */}}
{{- define "vm-manager.commonEnv" -}}
- name: VM_MANAGER_RUN_DIR
  value: {{ include "vm-manager.runDir" . }}
- name: VM_MANAGER_LOG_FORMAT
  value: {{ .Values.logging.format | quote }}
- name: VM_MANAGER_LOG_LEVEL
  value: {{ .Values.logging.level | quote }}
{{- if .Values.oidc.issuer }}
- name: VM_MANAGER_OIDC_ISSUER
  value: {{ .Values.oidc.issuer | quote }}
- name: VM_MANAGER_OIDC_AUDIENCES
  value: {{ join "," .Values.oidc.audiences | quote }}
{{- if .Values.oidc.caSecret.name }}
- name: SSL_CERT_FILE
  value: {{ printf "%s/%s" (include "vm-manager.caDir" .) .Values.oidc.caSecret.key }}
{{- end }}
{{- end }}
{{- end }}

{{- define "vm-manager.commonMounts" -}}
- name: run
  mountPath: {{ include "vm-manager.runMount" . }}
- name: tmp
  mountPath: /tmp
{{- if and .Values.oidc.issuer .Values.oidc.caSecret.name }}
- name: oidc-ca
  mountPath: {{ include "vm-manager.caDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{/* The security context of every container but a privileged hypervisor. */}}
{{- define "vm-manager.restrictedSecurityContext" -}}
runAsNonRoot: true
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The anonymous API answers only the Hosts it knows (DNS rebinding): the Service's
names, and the operator's. */}}
{{- define "vm-manager.allowedHostsArg" -}}
{{- $svc := include "vm-manager.fullname" . }}
{{- $hosts := list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) }}
{{- printf "--allowed-hosts=%s" (join "," (concat $hosts .Values.gateway.allowedHosts)) | quote }}
{{- end }}

{{- define "vm-manager.podTemplate" -}}
{{- $v := .Values -}}
{{- $fleet := eq $v.mode "fleet" -}}
metadata:
  labels:
    {{- include "vm-manager.nodeSelectorLabels" . | nindent 4 }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $v.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  serviceAccountName: {{ include "vm-manager.serviceAccountName" . }}
  automountServiceAccountToken: false
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- range . }}
    - name: {{ . }}
    {{- end }}
  {{- end }}
  securityContext:
    runAsNonRoot: true
    runAsUser: {{ $v.podSecurityContext.runAsUser }}
    runAsGroup: {{ $v.podSecurityContext.runAsGroup }}
    fsGroup: {{ $v.podSecurityContext.fsGroup }}
    fsGroupChangePolicy: OnRootMismatch
    {{- with $v.podSecurityContext.supplementalGroups }}
    supplementalGroups:
      {{- toYaml . | nindent 6 }}
    {{- end }}
    seccompProfile:
      type: RuntimeDefault
  {{- $nodeSelector := $v.nodeSelector }}
  {{- if eq $v.mode "daemonset" }}
  {{- $nodeSelector = merge (deepCopy $v.nodeSelector) $v.daemonset.nodeSelector }}
  {{- else if $fleet }}
  {{- $nodeSelector = merge (deepCopy $v.nodeSelector) $v.fleet.nodeSelector }}
  {{- end }}
  {{- with $nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if $fleet }}
  affinity:
    podAntiAffinity:
      # One node pod per KVM node: a second would fight the first for the node's
      # CPUs and memory that placement counts, and its VMs would share the failure.
      requiredDuringSchedulingIgnoredDuringExecution:
        - topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "vm-manager.nodeSelectorLabels" . | nindent 14 }}
  {{- end }}
  {{- if $v.guestImage.enabled }}
  initContainers:
    - name: guest-image
      image: {{ include "vm-manager.image" (dict "root" . "component" "hypervisor") }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command:
        - /usr/local/bin/vmm-hypervisor
        - image
        - pull
        - {{ include "vm-manager.guestImageRef" . | quote }}
        - {{ printf "--image-dir=%s" (include "vm-manager.imageDir" .) | quote }}
        {{- if $v.guestImage.plainHTTP }}
        - --plain-http
        {{- end }}
      env:
        - name: VM_MANAGER_STATE_DIR
          value: {{ include "vm-manager.stateDir" . }}
        - name: VM_MANAGER_LOG_FORMAT
          value: {{ $v.logging.format | quote }}
        {{- if $v.guestImage.pullSecret }}
        - name: DOCKER_CONFIG
          value: {{ include "vm-manager.dockerConfigDir" . }}
        {{- end }}
      securityContext:
        {{- include "vm-manager.restrictedSecurityContext" . | nindent 8 }}
      {{- with $v.guestImage.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: state
          mountPath: {{ include "vm-manager.stateDir" . }}
        - name: tmp
          mountPath: /tmp
        {{- if $v.guestImage.pullSecret }}
        - name: registry-auth
          mountPath: {{ include "vm-manager.dockerConfigDir" . }}
          readOnly: true
        {{- end }}
  {{- end }}
  containers:
    - name: hypervisor
      image: {{ include "vm-manager.image" (dict "root" . "component" "hypervisor") }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command:
        - /usr/local/bin/vmm-hypervisor
        - serve
      args:
        - --detach-vms-on-exit=false
        - {{ printf "--default-network=%s" $v.vm.defaultNetwork | quote }}
        - {{ printf "--network-subnet=%s" $v.vm.networkSubnet | quote }}
        - {{ printf "--install-timeout=%s" $v.vm.installTimeout | quote }}
        - {{ printf "--boot-timeout=%s" $v.vm.bootTimeout | quote }}
        - {{ printf "--stop-timeout=%s" $v.vm.stopTimeout | quote }}
        - {{ printf "--accelerator=%s" $v.vm.accelerator | quote }}
        - {{ printf "--metrics-guest-series-limit=%d" (int $v.metrics.guestSeriesLimit) | quote }}
        {{- if $v.vm.notifyPort }}
        - {{ printf "--notify-port=%d" (int64 $v.vm.notifyPort) | quote }}
        {{- end }}
        {{- with $v.vm.ovmf.code }}
        - {{ printf "--ovmf-code=%s" . | quote }}
        {{- end }}
        {{- with $v.vm.ovmf.vars }}
        - {{ printf "--ovmf-vars=%s" . | quote }}
        {{- end }}
        {{- range $v.hypervisor.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        - name: VM_MANAGER_STATE_DIR
          value: {{ include "vm-manager.stateDir" . }}
        - name: VM_MANAGER_IMAGE_DIR
          value: {{ include "vm-manager.imageDir" . }}
        {{- if $fleet }}
        # The pod's StatefulSet ordinal is its node index, the prefix of its VM ids.
        - name: VM_MANAGER_NODE_INDEX
          valueFrom:
            fieldRef:
              fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
        - name: VM_MANAGER_NODE_NAME
          valueFrom:
            fieldRef:
              fieldPath: spec.nodeName
        {{- end }}
        {{- include "vm-manager.commonEnv" . | nindent 8 }}
        {{- with $v.hypervisor.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      securityContext:
        {{- if $v.hypervisor.privileged }}
        privileged: true
        runAsNonRoot: true
        readOnlyRootFilesystem: true
        {{- else }}
        {{- include "vm-manager.restrictedSecurityContext" . | nindent 8 }}
        {{- end }}
      {{- $res := deepCopy (default dict $v.hypervisor.resources) }}
      {{- if not $v.hypervisor.privileged }}
      {{- $_ := set $res "limits" (merge (deepCopy (default dict $res.limits)) $v.hypervisor.deviceResources) }}
      {{- end }}
      {{- with $res }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: state
          mountPath: {{ include "vm-manager.stateDir" . }}
        {{- include "vm-manager.commonMounts" . | nindent 8 }}
    - name: attestation
      image: {{ include "vm-manager.image" (dict "root" . "component" "attestation") }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command:
        - /usr/local/bin/vmm-attestation
        - serve
      args:
        - {{ printf "--attestation=%s" $v.vm.attestation | quote }}
        - {{ printf "--attestation-learn-golden=%t" $v.vm.learnGolden | quote }}
        - {{ printf "--attestation-learn-golden-acknowledge=%t" $v.vm.learnGoldenAcknowledge | quote }}
        {{- range $v.attestation.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        - name: VM_MANAGER_STATE_DIR
          value: {{ include "vm-manager.stateDir" . }}
        {{- include "vm-manager.commonEnv" . | nindent 8 }}
        {{- with $v.attestation.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      securityContext:
        {{- include "vm-manager.restrictedSecurityContext" . | nindent 8 }}
      {{- with $v.attestation.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: state
          mountPath: {{ include "vm-manager.stateDir" . }}
        {{- include "vm-manager.commonMounts" . | nindent 8 }}
    - name: gateway
      image: {{ include "vm-manager.image" (dict "root" . "component" "gateway") }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      command:
        - /usr/local/bin/vmm-gateway
        - serve
      args:
        - --listen=:8080
        - {{ printf "--metrics-enabled=%t" $v.metrics.enabled | quote }}
        {{- if not $v.oidc.issuer }}
        - --allow-anonymous-non-loopback
        - {{ include "vm-manager.allowedHostsArg" . }}
        {{- end }}
        {{- if $fleet }}
        - {{ printf "--tls-cert-file=%s/tls.crt" (include "vm-manager.tlsDir" .) | quote }}
        - {{ printf "--tls-key-file=%s/tls.key" (include "vm-manager.tlsDir" .) | quote }}
        {{- end }}
        {{- range $v.gateway.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        {{- include "vm-manager.commonEnv" . | nindent 8 }}
        {{- with $v.gateway.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: http
          containerPort: 8080
          protocol: TCP
      livenessProbe:
        httpGet:
          path: /healthz
          port: http
          {{- if $fleet }}
          scheme: HTTPS
          {{- end }}
        periodSeconds: 10
        timeoutSeconds: 5
        failureThreshold: 6
      readinessProbe:
        httpGet:
          path: /readyz
          port: http
          {{- if $fleet }}
          scheme: HTTPS
          {{- end }}
        periodSeconds: 5
        timeoutSeconds: 5
        failureThreshold: 3
      securityContext:
        {{- include "vm-manager.restrictedSecurityContext" . | nindent 8 }}
      {{- with $v.gateway.resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        {{- include "vm-manager.commonMounts" . | nindent 8 }}
        {{- if $fleet }}
        - name: tls
          mountPath: {{ include "vm-manager.tlsDir" . }}
          readOnly: true
        {{- end }}
  volumes:
    {{- if $fleet }}
    # state: the StatefulSet's volumeClaimTemplate.
    - name: tls
      secret:
        secretName: {{ include "vm-manager.tlsSecret" . }}
        defaultMode: 0440
        items:
          - key: tls.crt
            path: tls.crt
          - key: tls.key
            path: tls.key
    {{- else }}
    - name: state
      {{- if or $v.persistence.create $v.persistence.existingClaim }}
      persistentVolumeClaim:
        claimName: {{ include "vm-manager.claimName" . }}
      {{- else }}
      emptyDir: {}
      {{- end }}
    {{- end }}
    - name: run
      emptyDir:
        medium: Memory
        sizeLimit: 16Mi
    - name: tmp
      emptyDir:
        sizeLimit: 1Gi
    {{- if and $v.oidc.issuer $v.oidc.caSecret.name }}
    - name: oidc-ca
      secret:
        secretName: {{ $v.oidc.caSecret.name }}
        defaultMode: 0444
        items:
          - key: {{ $v.oidc.caSecret.key }}
            path: {{ $v.oidc.caSecret.key }}
    {{- end }}
    {{- if and $v.guestImage.enabled $v.guestImage.pullSecret }}
    - name: registry-auth
      secret:
        secretName: {{ $v.guestImage.pullSecret }}
        defaultMode: 0444
        items:
          - key: .dockerconfigjson
            path: config.json
    {{- end }}
{{- end }}
