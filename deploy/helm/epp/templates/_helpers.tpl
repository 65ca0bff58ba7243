{{/* The EPP's name: <pool>-epp, at most 63 characters. */}}
{{- define "epp.name" -}}
{{- printf "%s-epp" .Values.inferencePool.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "epp.labels" -}}
app.kubernetes.io/name: epp
app.kubernetes.io/instance: {{ include "epp.name" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "epp.selectorLabels" -}}
app.kubernetes.io/name: epp
app.kubernetes.io/instance: {{ include "epp.name" . }}
{{- end -}}

{{/* True (non-empty) in standalone mode. */}}
{{- define "epp.standalone" -}}
{{- if .Values.standalone.selector -}}true{{- end -}}
{{- end -}}
