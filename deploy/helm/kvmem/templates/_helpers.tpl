{{/* Chart name as a DNS label. */}}
{{- define "kvmem.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-scoped name of every object. */}}
{{- define "kvmem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvmem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvmem.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvmem.labels" -}}
{{ include "kvmem.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvmem
{{- end -}}

{{/* The CPU image, or its -cuda twin for the CUDA backend. */}}
{{- define "kvmem.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}{{ if eq .Values.kvmemd.backend "cuda" }}-cuda{{ end }}
{{- end -}}

{{- define "kvmem.socket" -}}
unix:{{ .Values.socketDir }}/kvmemd.sock
{{- end -}}

{{/* Fails the render on a mode or backend the chart does not know. */}}
{{- define "kvmem.validate" -}}
{{- if not (has .Values.mode (list "sidecar" "daemonset")) -}}
{{- fail (printf "mode must be sidecar or daemonset, not %q" .Values.mode) -}}
{{- end -}}
{{- if not (has .Values.kvmemd.backend (list "cpu" "cuda")) -}}
{{- fail (printf "kvmemd.backend must be cpu or cuda, not %q" .Values.kvmemd.backend) -}}
{{- end -}}
{{- end -}}

{{- define "kvmem.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.uid }}
runAsGroup: {{ .Values.uid }}
fsGroup: {{ .Values.uid }}
seccompProfile: {type: RuntimeDefault}
{{- end -}}

{{/* kvmemd.resources, plus one GPU for the CUDA backend. */}}
{{- define "kvmem.kvmemdResources" -}}
{{- $res := deepCopy .Values.kvmemd.resources -}}
{{- if eq .Values.kvmemd.backend "cuda" -}}
{{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" 1) (default (dict) $res.limits)) -}}
{{- $_ := set $res "requests" (merge (dict "nvidia.com/gpu" 1) (default (dict) $res.requests)) -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* The kvmemd container: a native sidecar (init container, restartPolicy Always) in sidecar
mode, the DaemonSet's container otherwise. Probes are GetInfo calls over the socket (kvmemctl
info, 5 s deadline): they fail while kvmemd starts, drains or hangs. */}}
{{- define "kvmem.kvmemdContainer" -}}
- name: kvmemd
  image: {{ include "kvmem.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- if eq .Values.mode "sidecar" }}
  restartPolicy: Always
  {{- end }}
  command: ["/usr/local/bin/kvmemd"]
  args: ["--flagfile=/etc/kvmem/kvmemd.flags"]
  ports:
    - name: metrics
      containerPort: {{ .Values.kvmemd.metricsPort }}
      protocol: TCP
  startupProbe:
    exec: {command: ["/usr/local/bin/kvmemctl", "--target={{ include "kvmem.socket" . }}", "info"]}
    periodSeconds: 2
    timeoutSeconds: 6
    failureThreshold: 60
  readinessProbe:
    exec: {command: ["/usr/local/bin/kvmemctl", "--target={{ include "kvmem.socket" . }}", "info"]}
    periodSeconds: 10
    timeoutSeconds: 6
  livenessProbe:
    exec: {command: ["/usr/local/bin/kvmemctl", "--target={{ include "kvmem.socket" . }}", "info"]}
    periodSeconds: 20
    timeoutSeconds: 6
    failureThreshold: 3
  resources:
    {{- include "kvmem.kvmemdResources" . | nindent 4 }}
  securityContext:
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities: {drop: [ALL]}
  volumeMounts:
    - name: kvmem-socket
      mountPath: {{ .Values.socketDir }}
    - name: kvmemd-flags
      mountPath: /etc/kvmem
      readOnly: true
{{- end -}}
