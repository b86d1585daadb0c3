{{/* Names and labels shared by every template. */}}

{{- define "dcr.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dcr.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s-operator" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dcr.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "dcr.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "dcr.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dcr.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "dcr.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dcr.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "dcr.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
What the operator does, and nothing more (docs/operations.md explains each rule).
Namespaced rules, in two parts: "watch" (the custom resources, their status, pods,
Events) and "workloads" (Secrets, the profile ConfigMap, encoder Jobs: what makes the
operator able to run pods and read credentials in a namespace). A per-namespace Role
gets both; watching every namespace, the ClusterRole gets only "watch" and "workloads"
is granted per namespace (rbac.workloadNamespaces) unless rbac.workloadsClusterWide.
*/}}
{{- define "dcr.watchRules" -}}
# Watch both kinds; kopf patches its annotations and the finalizer on them.
- apiGroups: ["dcr.dev"]
  resources: ["rolloutfleets", "weightrefits"]
  verbs: ["get", "list", "watch", "patch"]
# Finished WeightRefits past a fleet's refitHistoryLimit or TTL are deleted.
- apiGroups: ["dcr.dev"]
  resources: ["weightrefits"]
  verbs: ["delete"]
# The commit record (compare-and-set), receivers, conditions, attempts.
- apiGroups: ["dcr.dev"]
  resources: ["rolloutfleets/status", "weightrefits/status"]
  verbs: ["get", "patch"]
# Receivers are the fleet's pods.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list"]
# Transitions as Events.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}

{{- define "dcr.workloadRules" -}}
# Agent tokens and store/relay credentials (tokenSecretRef, credentialsSecretRef), by
# name, used only if labelled for that use (dcr.dev/agent-token, ...: docs/operations.md).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get"]
# A fleet's peer read token (spec.catchUp.peers: <fleet>-peer-token), made once; never
# updated, listed or deleted (the fleet's ownerReference removes it).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# A fleet's peers' headless Service (<fleet>-peers), kept on the fleet's labels and port.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
# The merged receiver profile handed to encoder Jobs; each fleet's commit (<fleet>-commit),
# which its pods mount, kept equal to the record (patch).
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
# Encoder Jobs: one per attempt; obsolete ones are deleted.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "create", "delete"]
{{- end -}}

{{/* kopf discovers the resources it serves and the namespaces it may watch (always
cluster-scoped reads; without them it retries for minutes, then falls back). */}}
{{- define "dcr.discoveryRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end -}}

{{- define "dcr.peeringRules" -}}
- apiGroups: ["kopf.dev"]
  resources: [{{ . | quote }}]
  verbs: ["get", "list", "watch", "patch"]
{{- end -}}
