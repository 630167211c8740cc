{{/*
The Deployment, HPA and PodDisruptionBudget of a stateless component (ingress, router, result
service). Pass a dict: ctx, component, values (its block of values), command, port (the container
port serving /metrics), readinessPath, livenessPath, env (extra env YAML), volumes, mounts.
*/}}
{{- define "sluicegate.componentDeployment" -}}
{{- $ctx := .ctx -}}
{{- $v := .values -}}
{{- $name := printf "%s-%s" (include "sluicegate.fullname" $ctx) .component -}}
{{- $transport := include "sluicegate.transport" (dict "ctx" $ctx "component" .component) | fromYaml -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  labels:
    {{- include "sluicegate.labels" (dict "ctx" $ctx "component" .component) | nindent 4 }}
spec:
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ $v.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "sluicegate.selectorLabels" (dict "ctx" $ctx "component" .component) | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "sluicegate.labels" (dict "ctx" $ctx "component" .component) | nindent 8 }}
      annotations:
        {{- include "sluicegate.configChecksums" $ctx | nindent 8 }}
        {{- with $v.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "sluicegate.serviceAccountName" $ctx }}
      automountServiceAccountToken: false
      {{- with $ctx.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- include "sluicegate.podSecurityContext" $ctx | nindent 8 }}
        {{- with $ctx.Values.podSecurityContext }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "sluicegate.image" (dict "ctx" $ctx "image" $ctx.Values.image) }}
          imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
          args: [{{ .command | quote }}]
          ports:
            - name: metrics
              containerPort: {{ .port }}
              protocol: TCP
          envFrom:
            - configMapRef:
                name: {{ include "sluicegate.fullname" $ctx }}-config
          env:
            {{- include "sluicegate.commonEnv" $ctx | nindent 12 }}
            {{- with .env }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with $transport.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with $v.env }}
            {{- include "sluicegate.extraEnv" . | trim | nindent 12 }}
            {{- end }}
          readinessProbe:
            httpGet: {path: {{ .readinessPath }}, port: metrics}
            periodSeconds: 5
            failureThreshold: 3
          livenessProbe:
            httpGet: {path: {{ .livenessPath }}, port: metrics}
            periodSeconds: 10
            failureThreshold: 6
          resources:
            {{- toYaml $v.resources | nindent 12 }}
          securityContext:
            {{- include "sluicegate.containerSecurityContext" $ctx | nindent 12 }}
            {{- with $ctx.Values.containerSecurityContext }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          volumeMounts:
            {{- include "sluicegate.scratchMounts" $ctx | nindent 12 }}
            {{- with .mounts }}
            {{- . | nindent 12 }}
            {{- end }}
            {{- with $transport.mounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- include "sluicegate.scratchVolumes" $ctx | nindent 8 }}
        {{- with .volumes }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $transport.volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- if $v.autoscaling.enabled }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ $name }}
  labels:
    {{- include "sluicegate.labels" (dict "ctx" $ctx "component" .component) | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ $name }}
  minReplicas: {{ $v.autoscaling.minReplicas }}
  maxReplicas: {{ $v.autoscaling.maxReplicas }}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $v.autoscaling.targetCPUUtilizationPercentage }}
{{- end }}
{{- if $v.pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ $name }}
  labels:
    {{- include "sluicegate.labels" (dict "ctx" $ctx "component" .component) | nindent 4 }}
spec:
  minAvailable: {{ $v.pdb.minAvailable }}
  selector:
    matchLabels:
      {{- include "sluicegate.selectorLabels" (dict "ctx" $ctx "component" .component) | nindent 6 }}
{{- end }}
{{- end -}}

{{/* A ClusterIP Service with the public port (if any) and the `metrics` port the ServiceMonitor scrapes. */}}
{{- define "sluicegate.componentService" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ printf "%s-%s" (include "sluicegate.fullname" .ctx) .component }}
  labels:
    {{- include "sluicegate.labels" (dict "ctx" .ctx "component" .component "model" .model) | nindent 4 }}
    sluicegate.io/scrape: "true"
  {{- with .annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  type: {{ .type | default "ClusterIP" }}
  selector:
    {{- include "sluicegate.selectorLabels" (dict "ctx" .ctx "component" .selectorComponent "model" .model) | nindent 4 }}
  ports:
    {{- if .publicPort }}
    - name: http
      port: {{ .publicPort }}
      targetPort: metrics
      protocol: TCP
    {{- end }}
    - name: metrics
      port: {{ .port }}
      targetPort: metrics
      protocol: TCP
{{- end -}}
