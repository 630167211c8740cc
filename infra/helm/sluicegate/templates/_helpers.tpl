{{/* Names, labels and the small computations every template shares. */}}

{{- define "sluicegate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sluicegate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object; pass (dict "ctx" $ "component" "ingress"). */}}
{{- define "sluicegate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: sluicegate
{{ include "sluicegate.selectorLabels" . }}
{{- end -}}

{{/* The immutable subset used in selectors; a worker adds sluicegate.io/model. */}}
{{- define "sluicegate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sluicegate.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- if .model }}
sluicegate.io/model: {{ .model }}
{{- end }}
{{- end -}}

{{- define "sluicegate.image" -}}
{{- $tag := .image.tag | default .ctx.Chart.AppVersion -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "sluicegate.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-secrets" (include "sluicegate.fullname" .)) -}}
{{- end -}}

{{- define "sluicegate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "sluicegate.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/*
A model entry merged over workerDefaults, as YAML: maps merge key by key (at every depth) and any
value the model sets wins, including false and 0 (sprig's mergeOverwrite would skip those, and
"minReplicaCount: 0" for a batch pool must win over the default of 1).
*/}}
{{- define "sluicegate.deepMerge" -}}
{{- $base := deepCopy (index . 0) -}}
{{- range $key, $value := (index . 1) -}}
{{- if and (kindIs "map" $value) (kindIs "map" (get $base $key)) -}}
{{- $_ := set $base $key (include "sluicegate.deepMerge" (list (get $base $key) $value) | fromYaml) -}}
{{- else -}}
{{- $_ := set $base $key $value -}}
{{- end -}}
{{- end -}}
{{- toYaml $base -}}
{{- end -}}

{{/* One model with its defaults filled in, plus its Kubernetes-safe key; pass (list $ $model). */}}
{{- define "sluicegate.model" -}}
{{- $ctx := index . 0 -}}
{{- $model := include "sluicegate.deepMerge" (list $ctx.Values.workerDefaults (index . 1)) | fromYaml -}}
{{- if not $model.key -}}
{{- $_ := set $model "key" ($model.name | lower | replace "." "-" | replace "_" "-" | trunc 40 | trimSuffix "-") -}}
{{- end -}}
{{- toYaml $model -}}
{{- end -}}

{{/* Topic and group names, as schemas/names.py builds them (model names are topic-safe, see the schema). */}}
{{- define "sluicegate.requestTopic" -}}
{{- printf "%sllm.%s.%s" .ctx.Values.kafka.topicPrefix .model .tier -}}
{{- end -}}

{{- define "sluicegate.workerGroup" -}}
{{- printf "%ssluicegate-workers.%s" .ctx.Values.kafka.topicPrefix .model -}}
{{- end -}}

{{/* Pod and container security shared by every workload: a non-root user, nothing writable but volumes. */}}
{{- define "sluicegate.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "sluicegate.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* Settings every process reads: the ConfigMap, then the Redis URL from the Secret. */}}
{{- define "sluicegate.commonEnv" -}}
- name: SLUICEGATE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "sluicegate.secretName" . }}
      key: SLUICEGATE_REDIS_URL
{{- end -}}

{{- define "sluicegate.streamTokenEnv" -}}
- name: SLUICEGATE_STREAM_TOKEN_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "sluicegate.secretName" . }}
      key: SLUICEGATE_STREAM_TOKEN_SECRET
{{- end -}}

{{/* Extra SLUICEGATE_* variables from a values map, sorted so renders are stable. */}}
{{- define "sluicegate.extraEnv" -}}
{{- range $name, $value := . }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end -}}
{{- end -}}

{{/* Writable folders for a read-only root filesystem. */}}
{{- define "sluicegate.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: state
  emptyDir: {}
{{- end -}}

{{- define "sluicegate.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: state
  mountPath: /var/lib/sluicegate
{{- end -}}

{{/* Rolls pods when the settings or secrets change. */}}
{{- define "sluicegate.configChecksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secrets: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end -}}
