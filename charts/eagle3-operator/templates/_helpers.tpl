{{/* Release-scoped name for the operator's objects, within the 63-character limit. */}}
{{- define "eagle3-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels that select the operator pod; fixed for the life of the release. */}}
{{- define "eagle3-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "eagle3-operator.labels" -}}
{{ include "eagle3-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: eagle3-target
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "eagle3-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "eagle3-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "eagle3-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- /* What the operator does inside a served namespace: read targets and write their status, own the
     children (server-side apply = create + patch, pruning = delete, get = is a child's name taken by
     someone else), watch the server pods and post events. Nothing else: it reads no Secret (the servers
     answer its probes without a token). */}}
{{- define "eagle3-operator.namespacedRules" -}}
- apiGroups: [eagle3.dev]
  resources: [eagle3targets]
  verbs: [list, watch]
- apiGroups: [eagle3.dev]
  resources: [eagle3targets/status]
  verbs: [patch]
# Children's owner references set blockOwnerDeletion, which clusters that enforce owner-reference
# permissions (the OwnerReferencesPermissionEnforcement admission plugin) allow only with this.
- apiGroups: [eagle3.dev]
  resources: [eagle3targets/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, delete]
# A target's NetworkPolicy (spec.networkPolicy).
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
# The hydration Job that downloads a huggingFace source once for all replicas (its pods are read above).
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, patch, delete]
# PodMonitors are applied (when their CRD exists) and deleted when disabled, but not watched: each
# target's is looked up by name once per operator start.
- apiGroups: [monitoring.coreos.com]
  resources: [podmonitors]
  verbs: [get, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end }}
