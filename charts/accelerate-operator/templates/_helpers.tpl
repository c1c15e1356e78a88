{{/*
Names and labels shared by every template. Kubernetes names are limited to 63 characters.
*/}}

{{/* The chart's name. */}}
{{- define "accelerate-operator.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The release's full name: the release name alone when it already contains the chart name
(`helm install accelerate-operator ...`), else "<release>-<chart>".
*/}}
{{- define "accelerate-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* "<chart>-<version>" for the helm.sh/chart label. */}}
{{- define "accelerate-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select the operator pod; never change them after a release (selectors are immutable). */}}
{{- define "accelerate-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "accelerate-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of every object the chart renders. */}}
{{- define "accelerate-operator.labels" -}}
helm.sh/chart: {{ include "accelerate-operator.chart" . }}
{{ include "accelerate-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: accelerate-operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The ServiceAccount the operator runs as. */}}
{{- define "accelerate-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "accelerate-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name must name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The report endpoint's Service port, the Secret of its TLS, and the URL the pods reach it at. */}}
{{- define "accelerate-operator.reportSecret" -}}
{{- printf "%s-report-tls" (include "accelerate-operator.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- define "accelerate-operator.reportURL" -}}
{{- printf "https://%s.%s.svc:%d" (include "accelerate-operator.fullname" .) .Release.Namespace (int .Values.reports.port) }}
{{- end }}

{{/* The operator image: pinned by image.digest when set, else tagged with image.tag or the chart's appVersion. */}}
{{- define "accelerate-operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The metrics Service's name: the full name cut to leave room for the suffix (63 in all). */}}
{{- define "accelerate-operator.metricsService" -}}
{{- printf "%s-metrics" (include "accelerate-operator.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/*
RBAC rules the operator needs in every namespace it watches (least privilege). No Secret access
there: the one Secret the operator reads, its report endpoint's TLS, is in its own namespace
(templates/report-endpoint.yaml).
*/}}
{{- define "accelerate-operator.namespacedRules" -}}
# The jobs: watched (kopf writes nothing to them: no finalizer, annotation or diff-base), read
# by name (the deletion grace check), deleted after spec.runPolicy.ttlSecondsAfterFinished.
- apiGroups: ["accelerate-operator.io"]
  resources: ["acceleratejobs"]
  verbs: ["get", "list", "watch", "delete"]
# Their status: one merge patch per pass.
- apiGroups: ["accelerate-operator.io"]
  resources: ["acceleratejobs/status"]
  verbs: ["patch"]
# Children (pods, the Workload) name their job as owner with blockOwnerDeletion: where the
# OwnerReferencesPermissionEnforcement admission plugin is on, that needs update on the owner's
# finalizers.
- apiGroups: ["accelerate-operator.io"]
  resources: ["acceleratejobs/finalizers"]
  verbs: ["update"]
# The group's pods: watched (the report endpoint checks each caller against this cache),
# created, deleted at a restart; patch: the annotation accelerate-operator.io/run-attempt, which
# asks a job's pods to launch again in place (spec.runPolicy.restartInPlace).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
# The head of pod 0's log (the trainer's versions) and the logs archived before a restart.
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# The job's headless Service (the pods' DNS names), created once.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create"]
# The job's ConfigMap (the accelerate YAML) and its archived logs, created once; patch: the
# report endpoint's CA bundle (key report-ca.crt) in each job's ConfigMap, when the operator
# renews its CA. RBAC cannot narrow patch to names made at run time.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
# One event per transition (core/v1, what kubectl describe lists; kopf posts none); list: the
# Warning events of a pod long in ContainerCreating, the only place Kubernetes says why (a volume
# it cannot mount), one pod per pass.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "list"]
# The PodDisruptionBudget of a job with spec.runPolicy.podDisruptionBudget (owned by the job).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create"]
# kopf's peering between the replicas: the KopfPeering of each watched namespace (created at
# start-up if missing), its keep-alive records patched, watched to pause or resume.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- if .Values.kueue.enabled }}
# Kueue: the Workload of each queued job (created, watched, spec.active patched for a suspend)
# and its status (quota released after an eviction, PodsReady, Finished). RBAC names no
# version: these rules cover v1beta1 and v1beta2 alike (the version is discovered at start from
# /apis/kueue.x-k8s.io, which every authenticated user may read).
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list", "watch", "create", "patch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- end }}
{{- end }}

{{/*
RBAC rules that only exist cluster-wide: with kueue.enabled, Kueue's cluster-scoped
ResourceFlavors and WorkloadPriorityClasses; nothing otherwise (the operator watches its own
collections by path: it needs neither CRDs nor namespaces listed).
*/}}
{{- define "accelerate-operator.clusterRules" -}}
# The report endpoint checks each pod's token (audience accelerate-operator.io/report) itself,
# against the public keys the API server publishes for its service-account issuer (OIDC
# discovery): no TokenReview, no call per token. Kubernetes grants these to every service account
# (ClusterRoleBinding system:service-account-issuer-discovery); named here for clusters that
# removed that binding.
- nonResourceURLs: ["/.well-known/openid-configuration", "/openid/v1/jwks"]
  verbs: ["get"]
# The node of a pod that runs but is not Ready, or outlived its deletion's grace period: whether
# the node is lost (spec.runPolicy.nodeLostTimeoutSeconds). Read by name, never listed.
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get"]
{{- if empty .Values.watchNamespaces }}
# kopf's peering for an operator watching every namespace: one ClusterKopfPeering.
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- end }}
{{- if .Values.kueue.enabled }}
# Kueue's cluster-wide objects, read by name: the flavors a job was admitted with (node labels,
# tolerations) and the value of its priority class.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["resourceflavors", "workloadpriorityclasses"]
  verbs: ["get"]
{{- end }}
{{- end }}
