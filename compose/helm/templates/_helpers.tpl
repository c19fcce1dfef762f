{{/* Names: RELEASE-pdserve (or RELEASE when it says pdserve), short enough for a suffix. */}}
{{- define "pdserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pdserve.labels" -}}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* Labels of one component: include "pdserve.componentLabels" (list $ "scheduler") */}}
{{- define "pdserve.componentLabels" -}}
{{ include "pdserve.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "pdserve.componentSelector" -}}
{{ include "pdserve.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "pdserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "pdserve.schedulerAddress" -}}
{{ include "pdserve.fullname" . }}-scheduler:{{ .Values.scheduler.port }}
{{- end -}}

{{- define "pdserve.kvSecretName" -}}
{{ .Values.kvSecret.existingSecret | default (printf "%s-kv" (include "pdserve.fullname" .)) }}
{{- end -}}

{{/* The scheduler's --mode: colocated without a prefill pool. */}}
{{- define "pdserve.mode" -}}
{{- if .Values.scheduler.mode -}}
{{ .Values.scheduler.mode }}
{{- else if eq (int .Values.prefill.replicas) 0 -}}
colocated
{{- else -}}
disaggregated
{{- end -}}
{{- end -}}

{{/* The checkpoint's directory inside /models. */}}
{{- define "pdserve.modelDir" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "existing" -}}
{{- required "model.path: the checkpoint directory on the volume (model.source existing)" $m.path | trimPrefix "/" -}}
{{- else if or (eq $m.source "fetch") (eq $m.source "tiny") -}}
{{- required "model.name" $m.name -}}
{{- else -}}
{{- fail (printf "model.source %q: known: fetch, tiny, existing" $m.source) -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.modelPath" -}}
/models/{{ include "pdserve.modelDir" . }}
{{- end -}}

{{- define "pdserve.servedModelName" -}}
{{- .Values.model.servedModelName | default (include "pdserve.modelDir" .) -}}
{{- end -}}

{{/* The /models volume. */}}
{{- define "pdserve.modelVolume" -}}
{{- $m := .Values.model -}}
{{- if and (eq $m.source "tiny") (or $m.existingClaim $m.hostPath) -}}
{{- fail "model.source tiny writes the model in every pod: use it with the default emptyDir, not model.existingClaim or model.hostPath" -}}
{{- end -}}
- name: models
{{- if $m.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ $m.existingClaim }}
    readOnly: {{ eq $m.source "existing" }}
{{- else if $m.hostPath }}
  hostPath:
    path: {{ $m.hostPath }}
    type: {{ ternary "Directory" "DirectoryOrCreate" (eq $m.source "existing") }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $m.sizeLimit }}
{{- end }}
{{- end -}}

{{/* The initContainer that puts the model on the volume; nothing for an existing one. */}}
{{- define "pdserve.modelInit" -}}
{{- $m := .Values.model -}}
{{- if ne $m.source "existing" }}
- name: model
  image: {{ include "pdserve.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: [pdserve]
  {{- if eq $m.source "fetch" }}
  args: [fetch-model, {{ $m.name | quote }}, {{ include "pdserve.modelPath" . | quote }}]
  {{- else }}
  args: [make-tiny-model, {{ include "pdserve.modelPath" . | quote }}]
  {{- end }}
  env:
    - {name: PDSERVE_LOG_LEVEL, value: {{ .Values.logLevel | quote }}}
  volumeMounts:
    - {name: models, mountPath: /models}
  {{- with $m.initResources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    allowPrivilegeEscalation: false
{{- end }}
{{- end -}}

{{- define "pdserve.podAnnotations" -}}
{{- $ := index . 0 -}}
{{- if $.Values.metrics.podAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ index . 1 | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- with index . 2 }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "pdserve.tlsSecretName" -}}
{{ .Values.tls.existingSecret | default (printf "%s-tls" (include "pdserve.fullname" .)) }}
{{- end -}}

{{/* With TLS: PDSERVE_TLS_DIR, for a container's env. */}}
{{- define "pdserve.tlsEnv" -}}
{{- if .Values.tls.enabled }}
- {name: PDSERVE_TLS_DIR, value: /etc/pdserve/tls}
{{- end }}
{{- end -}}

{{/* With TLS: the mount of a role's files, for a container's volumeMounts. */}}
{{- define "pdserve.tlsMount" -}}
{{- if .Values.tls.enabled }}
- {name: tls, mountPath: /etc/pdserve/tls, readOnly: true}
{{- end }}
{{- end -}}

{{/* With TLS: the volume of one role's files (list $ role), for a pod's volumes. */}}
{{- define "pdserve.tlsVolume" -}}
{{- $ := index . 0 }}
{{- $role := index . 1 }}
{{- if $.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "pdserve.tlsSecretName" $ }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: {{ $role }}.crt, path: {{ $role }}.crt}
      - {key: {{ $role }}.key, path: {{ $role }}.key}
{{- end }}
{{- end -}}
