{{/* The pod template of one worker role: include "pdserve.workerPod" (list $ "prefill") */}}
{{- define "pdserve.workerPod" -}}
{{- $ := index . 0 -}}
{{- $role := index . 1 -}}
{{- $w := index $.Values $role -}}
{{- $ws := $.Values.workers -}}
{{- $gpu := $.Values.gpu -}}
{{- $profile := ternary $gpu $.Values.cpu $gpu.enabled -}}
{{- $labels := list $ (printf "%s-worker" $role) -}}
metadata:
  labels:
    {{- include "pdserve.componentLabels" $labels | nindent 4 }}
  {{- with include "pdserve.podAnnotations" (list $ $ws.metricsPort $ws.podAnnotations) }}
  annotations:
    {{- . | trim | nindent 4 }}
  {{- end }}
spec:
  automountServiceAccountToken: false
  enableServiceLinks: false
  terminationGracePeriodSeconds: {{ $ws.terminationGracePeriodSeconds }}
  {{- with $.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with include "pdserve.modelInit" $ }}
  initContainers:
    {{- . | trim | nindent 4 }}
  {{- end }}
  containers:
    - name: worker
      image: {{ include "pdserve.image" $ }}
      imagePullPolicy: {{ $.Values.image.pullPolicy }}
      command: [pdserve]
      args:
        - {{ $role }}-worker
        - --model
        - {{ include "pdserve.modelPath" $ | quote }}
        - --scheduler
        - {{ include "pdserve.schedulerAddress" $ }}
        - --kv-transports
        {{- range $ws.kvTransports }}
        - {{ . }}
        {{- end }}
        - --kv-host
        - 0.0.0.0
        - --kv-port
        - {{ $ws.kvPort | quote }}
        - --kv-advertise-host
        - $(POD_IP)                # peers dial this pod, not a Service
        - --health-host
        - 0.0.0.0
        - --health-port
        - {{ $ws.healthPort | quote }}
        - --metrics-host
        - 0.0.0.0
        - --metrics-port
        - {{ $ws.metricsPort | quote }}
        {{- if $gpu.enabled }}
        - --device
        - cuda
        - --gpu-memory-utilization
        - {{ $gpu.memoryUtilization | quote }}
        {{- else }}
        - --device
        - cpu
        - --cpu-threads
        - {{ $.Values.cpu.threads | quote }}
        - --kv-cache-memory-mib
        - {{ $.Values.cpu.kvCacheMemoryMiB | quote }}
        {{- end }}
        {{- with $.Values.otlp.endpoint }}
        - --otlp-traces-endpoint
        - {{ . | quote }}
        {{- end }}
        {{- range $w.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        - {name: PDSERVE_LOG_LEVEL, value: {{ $.Values.logLevel | quote }}}
        - name: POD_IP
          valueFrom:
            fieldRef: {fieldPath: status.podIP}
        - name: PDSERVE_KV_SECRET
          valueFrom:
            secretKeyRef: {name: {{ include "pdserve.kvSecretName" $ }}, key: {{ $.Values.kvSecret.key }}}
        {{- include "pdserve.tlsEnv" $ | nindent 8 }}
      ports:
        - {name: kv, containerPort: {{ $ws.kvPort }}}
        - {name: health, containerPort: {{ $ws.healthPort }}}
        - {name: metrics, containerPort: {{ $ws.metricsPort }}}
      # grpc.health.v1 "": SERVING while attached to the scheduler. The port opens once the model
      # is loaded; a worker detached for workers.detachedSeconds (the scheduler gone that long,
      # or the worker wedged) is restarted.
      startupProbe:
        grpc: {port: {{ $ws.healthPort }}}
        periodSeconds: 5
        failureThreshold: {{ div $ws.startupSeconds 5 }}
      readinessProbe:
        grpc: {port: {{ $ws.healthPort }}}
        periodSeconds: 5
        failureThreshold: 2
      livenessProbe:
        grpc: {port: {{ $ws.healthPort }}}
        periodSeconds: 10
        failureThreshold: {{ div $ws.detachedSeconds 10 }}
      volumeMounts:
        - {name: models, mountPath: /models, readOnly: true}
        - {name: shm, mountPath: /dev/shm}
        {{- include "pdserve.tlsMount" $ | nindent 8 }}
      resources:
        {{- $resources := deepCopy ($w.resources | default $profile.resources) }}
        {{- if $gpu.enabled }}
        {{- $_ := set $resources "limits" (merge (dict $gpu.resourceName $gpu.perWorker) ($resources.limits | default dict)) }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
      securityContext:
        allowPrivilegeEscalation: false
  volumes:
    {{- include "pdserve.modelVolume" $ | nindent 4 }}
    # on a CPU the KV cache is a /dev/shm file (shared-memory segments); on a GPU, torch's and NCCL's
    - name: shm
      emptyDir:
        medium: Memory
        {{- if $gpu.enabled }}
        sizeLimit: {{ $gpu.shmSizeLimit }}
        {{- else }}
        sizeLimit: {{ add $.Values.cpu.kvCacheMemoryMiB 256 }}Mi
        {{- end }}
    {{- include "pdserve.tlsVolume" (list $ "worker") | nindent 4 }}
  {{- with merge (deepCopy $w.nodeSelector) $profile.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with concat $profile.tolerations $w.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $w.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
