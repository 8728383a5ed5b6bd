{{- define "pdpair.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdpair.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pdpair.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdpair.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "pdpair.certSecret" -}}
{{- if eq .Values.webhook.certificates.mode "secret" -}}
{{- required "webhook.certificates.secretName is required when webhook.certificates.mode is secret" .Values.webhook.certificates.secretName -}}
{{- else -}}
{{- printf "%s-webhook-tls" (include "pdpair.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The webhook's host names: the Service's, and the host of webhook.url when set. */}}
{{- define "pdpair.webhookHosts" -}}
{{- $svc := printf "%s-webhook" (include "pdpair.fullname" .) -}}
{{- $hosts := list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.cluster.local" $svc .Release.Namespace) -}}
{{- if .Values.webhook.url -}}
{{- $host := .Values.webhook.url | trimPrefix "https://" | splitList "/" | first -}}
{{- if hasPrefix "[" $host -}}
{{- $host = $host | trimPrefix "[" | splitList "]" | first -}}
{{- else -}}
{{- $host = $host | splitList ":" | first -}}
{{- end -}}
{{- $hosts = append $hosts $host -}}
{{- end -}}
{{- toJson $hosts -}}
{{- end -}}

{{- define "pdpair.securityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- /* A component's ClusterRole bound everywhere, or, with operator.watchNamespaces, by a
RoleBinding in each of those namespaces only. */ -}}
{{- define "pdpair.bindings" -}}
{{- $root := .root -}}
{{- $name := printf "%s-%s" (include "pdpair.fullname" $root) .component -}}
{{- $scopes := $root.Values.operator.watchNamespaces | default (list "") -}}
{{- range $scopes }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: {{ if . }}RoleBinding{{ else }}ClusterRoleBinding{{ end }}
metadata:
  name: {{ $name }}
  {{- if . }}
  namespace: {{ . }}
  {{- end }}
  labels:
    {{- include "pdpair.labels" $root | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: {{ $name }}
subjects:
  - kind: ServiceAccount
    name: {{ $name }}
    namespace: {{ $root.Release.Namespace }}
{{- end }}
{{- end -}}
