{{/*
Secure transport to Kafka, Redis and the OTLP collector: which peers each component talks to, the Secrets
(CA, client certificate and key, SASL password, OAuth token) mounted read-only as files into the processes
that talk to them, and the variables that point each process at its files. The variable names are written
here and nowhere else in the chart, so a renamed setting is one edit.
*/}}

{{/*
The peers each component dials; the egress NetworkPolicies read the same map, so a component that gets a
peer's credentials also gets the rule to reach it. Every process exports traces when tracing is on, and the
result service produces to Kafka too (a Stop is a record on the control topic). A worker's package index
(wheelModel) is per model: networkpolicies.yaml adds it.
*/}}
{{- define "sluicegate.peersOf" -}}
ingress: [kafka, redis, otlp]
router: [kafka, redis, otlp]
result-service: [kafka, redis, otlp]
batch-worker: [kafka, redis, otlp]
worker: [kafka, redis, otlp]
{{- end -}}

{{/* Where the Secrets' files appear in a container: <root>/<volume>/<file>. Outside /etc/sluicegate,
which ingress's keys file volume covers (a mount inside a read-only Secret volume cannot be made). */}}
{{- define "sluicegate.secretFilesRoot" -}}/etc/sluicegate-secrets{{- end -}}

{{/* Whether traces are exported (so the OTLP collector must be reachable): pass (dict "ctx" $ "env" <component env>). */}}
{{- define "sluicegate.tracingOn" -}}
{{- $config := .ctx.Values.config | default dict -}}
{{- $env := .env | default dict -}}
{{- range $name := list "OTEL_EXPORTER_OTLP_ENDPOINT" "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" "SLUICEGATE_OTLP_ENDPOINT" -}}
{{- if or (get $config $name) (get $env $name) -}}true{{- end -}}
{{- end -}}
{{- if .ctx.Values.otlpEndpoint -}}true{{- end -}}
{{- end -}}

{{/* One NetworkPolicy egress rule from a peer's values {to, ports}; no `to` lets any destination in. */}}
{{- define "sluicegate.egressRule" -}}
- ports:
    {{- toYaml .ports | nindent 4 }}
  {{- with .to }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}

{{/*
A component's transport settings as YAML {env, volumes, mounts}; pass (dict "ctx" $ "component" "router").
Nothing is set for a plaintext peer, so the default install's pods carry no transport variables at all.
*/}}
{{- define "sluicegate.transport" -}}
{{- $ctx := .ctx -}}
{{- $peers := get (include "sluicegate.peersOf" $ctx | fromYaml) .component | default list -}}
{{- $env := list -}}
{{- $files := list -}}
{{- if has "kafka" $peers -}}
{{- $s := $ctx.Values.kafka.security -}}
{{- if ne $s.protocol "PLAINTEXT" -}}
{{- $env = append $env (dict "name" "SLUICEGATE_KAFKA_SECURITY_PROTOCOL" "value" $s.protocol) -}}
{{- end -}}
{{- if hasPrefix "SASL_" $s.protocol -}}
{{- $env = append $env (dict "name" "SLUICEGATE_KAFKA_SASL_MECHANISM" "value" $s.saslMechanism) -}}
{{- with $s.username -}}
{{- $env = append $env (dict "name" "SLUICEGATE_KAFKA_SASL_USERNAME" "value" .) -}}
{{- end -}}
{{- with $s.passwordSecret -}}
{{- $files = append $files (dict "volume" "kafka-sasl-password" "secret" .name "items" (list (dict "key" .key "path" "password" "env" "SLUICEGATE_KAFKA_SASL_PASSWORD_FILE"))) -}}
{{- end -}}
{{- with $s.oauthTokenSecret -}}
{{- $files = append $files (dict "volume" "kafka-oauth-token" "secret" .name "items" (list (dict "key" .key "path" "token" "env" "SLUICEGATE_KAFKA_SASL_OAUTH_TOKEN_FILE"))) -}}
{{- end -}}
{{- end -}}
{{- if has $s.protocol (list "SSL" "SASL_SSL") -}}
{{- $env = append $env (dict "name" "SLUICEGATE_KAFKA_SSL_CHECK_HOSTNAME" "value" (toString $s.checkHostname)) -}}
{{- with $s.caSecret -}}
{{- $files = append $files (dict "volume" "kafka-ca" "secret" .name "items" (list (dict "key" .key "path" "ca.crt" "env" "SLUICEGATE_KAFKA_SSL_CAFILE"))) -}}
{{- end -}}
{{- with $s.clientCertSecret -}}
{{- $files = append $files (dict "volume" "kafka-client-cert" "secret" .name "items" (list (dict "key" .certKey "path" "tls.crt" "env" "SLUICEGATE_KAFKA_SSL_CERTFILE") (dict "key" .keyKey "path" "tls.key" "env" "SLUICEGATE_KAFKA_SSL_KEYFILE"))) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if has "redis" $peers -}}
{{- $t := $ctx.Values.redis.tls | default dict -}}
{{- with $t.caSecret -}}
{{- $files = append $files (dict "volume" "redis-ca" "secret" .name "items" (list (dict "key" .key "path" "ca.crt" "env" "SLUICEGATE_REDIS_TLS_CA_FILE"))) -}}
{{- end -}}
{{- with $t.clientCertSecret -}}
{{- $files = append $files (dict "volume" "redis-client-cert" "secret" .name "items" (list (dict "key" .certKey "path" "tls.crt" "env" "SLUICEGATE_REDIS_TLS_CERT_FILE") (dict "key" .keyKey "path" "tls.key" "env" "SLUICEGATE_REDIS_TLS_KEY_FILE"))) -}}
{{- end -}}
{{- end -}}
{{- if has "otlp" $peers -}}
{{/* OpenTelemetry's own variables: the OTLP/HTTP span exporter reads them (sluicegate/telemetry.py). */}}
{{- $t := $ctx.Values.otlpTls | default dict -}}
{{- with $t.caSecret -}}
{{- $files = append $files (dict "volume" "otlp-ca" "secret" .name "items" (list (dict "key" .key "path" "ca.crt" "env" "OTEL_EXPORTER_OTLP_CERTIFICATE"))) -}}
{{- end -}}
{{- with $t.clientCertSecret -}}
{{- $files = append $files (dict "volume" "otlp-client-cert" "secret" .name "items" (list (dict "key" .certKey "path" "tls.crt" "env" "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE") (dict "key" .keyKey "path" "tls.key" "env" "OTEL_EXPORTER_OTLP_CLIENT_KEY"))) -}}
{{- end -}}
{{- end -}}
{{- $root := include "sluicegate.secretFilesRoot" $ctx -}}
{{- range $f := $files -}}
{{- range $f.items -}}
{{- $env = append $env (dict "name" .env "value" (printf "%s/%s/%s" $root $f.volume .path)) -}}
{{- end -}}
{{- end -}}
env: {{ toYaml $env | nindent 2 }}
{{- if $files }}
volumes:
{{- range $files }}
  - name: {{ .volume }}
    secret:
      secretName: {{ .secret }}
      # 0440: readable by the owner and the pod's fsGroup (the process runs in that group), by nobody else.
      defaultMode: 0440
      items:
        {{- range .items }}
        - key: {{ .key | quote }}
          path: {{ .path }}
        {{- end }}
{{- end }}
mounts:
{{- range $files }}
  - name: {{ .volume }}
    mountPath: {{ printf "%s/%s" $root .volume }}
    readOnly: true
{{- end }}
{{- else }}
volumes: []
mounts: []
{{- end }}
{{- end -}}

{{/*
Checks across sections that the schema cannot see; called once from configmap.yaml (always rendered).
*/}}
{{- define "sluicegate.checkTransport" -}}
{{- $s := .Values.kafka.security -}}
{{- if and .Values.keda.enabled (ne $s.protocol "PLAINTEXT") (not .Values.keda.kafkaAuthenticationRef) -}}
{{- fail (printf "kafka.security.protocol is %s but keda.kafkaAuthenticationRef is empty: KEDA reads the lag with a Kafka connection of its own; create a TriggerAuthentication with the same credentials and name it there (docs/deploy.md)" $s.protocol) -}}
{{- end -}}
{{- if and (not (has $s.protocol (list "SSL" "SASL_SSL"))) (or $s.caSecret $s.clientCertSecret) -}}
{{- fail (printf "kafka.security: caSecret and clientCertSecret are TLS files, but protocol %s does not use TLS (SSL or SASL_SSL)" $s.protocol) -}}
{{- end -}}
{{- if and (not (hasPrefix "SASL_" $s.protocol)) (or $s.saslMechanism $s.username $s.passwordSecret $s.oauthTokenSecret) -}}
{{- fail (printf "kafka.security: saslMechanism, username, passwordSecret and oauthTokenSecret are SASL values, but protocol %s does not use SASL (SASL_PLAINTEXT or SASL_SSL)" $s.protocol) -}}
{{- end -}}
{{- $redisTls := .Values.redis.tls | default dict -}}
{{- if and (or $redisTls.caSecret $redisTls.clientCertSecret) (not .Values.secrets.existingSecret) (not (hasPrefix "rediss" .Values.redis.url)) -}}
{{- fail "redis.tls: the CA and client certificate are used over TLS only, and redis.url is not rediss:// (or rediss+sentinel://)" -}}
{{- end -}}
{{- $otlpTls := .Values.otlpTls | default dict -}}
{{- if and (or $otlpTls.caSecret $otlpTls.clientCertSecret) (hasPrefix "http://" .Values.otlpEndpoint) -}}
{{- fail "otlpTls: the CA and client certificate are used over TLS only, and otlpEndpoint is http://; use https://" -}}
{{- end -}}
{{- end -}}
