{{/* Chart name, truncated to the 63 characters of a label value. */}}
{{- define "rljob-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's objects: <release>-<chart>, or the release name when it already contains the chart name. */}}
{{- define "rljob-operator.fullname" -}}
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

{{- define "rljob-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object of the release. */}}
{{- define "rljob-operator.labels" -}}
helm.sh/chart: {{ include "rljob-operator.chart" . }}
{{ include "rljob-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: rljob
{{- end }}

{{/* Immutable labels the operator Deployment selects its pod by. */}}
{{- define "rljob-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rljob-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "rljob-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rljob-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Operator image reference: repository@digest when a digest is given, else repository:tag (tag defaults to appVersion). */}}
{{- define "rljob-operator.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag }}
{{- $repository := .Values.image.repository }}
{{- with .Values.images.registry }}
{{- $repository = printf "%s/%s" (trimSuffix "/" .) $repository }}
{{- end }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" $repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}
{{- end }}

{{/* The operator's default images of RLJob children (RLJOB_IMAGE_DEFAULTS): the `images` values as JSON. */}}
{{- define "rljob-operator.imageDefaults" -}}
{{- toJson .Values.images }}
{{- end }}

{{/* Pull secrets of the operator pod: imagePullSecrets, then images.pullSecrets. */}}
{{- define "rljob-operator.imagePullSecrets" -}}
{{- $secrets := list }}
{{- range .Values.imagePullSecrets }}{{ $secrets = append $secrets (dict "name" .name) }}{{ end }}
{{- range .Values.images.pullSecrets }}{{ $secrets = append $secrets (dict "name" .) }}{{ end }}
{{- with $secrets | uniq }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/* Namespaces the PodMonitors select: explicit, else the watched ones, else any. */}}
{{- define "rljob-operator.podMonitorNamespaceSelector" -}}
{{- $namespaces := .Values.podMonitors.namespaces | default .Values.operator.watchNamespaces }}
{{- if $namespaces }}
namespaceSelector:
  matchNames:
    {{- toYaml $namespaces | nindent 4 }}
{{- else }}
namespaceSelector:
  any: true
{{- end }}
{{- end }}
