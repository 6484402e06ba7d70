{{/*
What the operator does in a namespace it watches, verb by verb (see docs/install.md "RBAC").
Server-side apply of a child needs get (read the resourceVersion), create (the first apply creates it)
and patch; list/watch only where the operator lists or kopf watches; delete only where it deletes.
The trainer's per-job Role grants get on its RLJob, get/patch on its status, create/patch on events and
get/list/watch on pods (worker discovery); the router's grants get/list/watch on pods (the sglang
router's Kubernetes service discovery). The operator holds all of these itself, so the API server lets
it create those Roles and their RoleBindings without the `escalate` or `bind` verbs.
*/}}
{{- define "rljob-operator.namespacedRules" -}}
# RLJobs: kopf lists and watches them and patches its progress annotations on them.
- apiGroups: ["rljob.io"]
  resources: ["rljobs"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["rljob.io"]
  resources: ["rljobs/status"]
  verbs: ["get", "patch"]
# Events for every decision (the trainer's Role grants create/patch, so the operator holds both).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
# Inference pools; pools removed from a spec are pruned.
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The trainer group (an Indexed Job): deleted and recreated to restart the whole gang.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The sglang router.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
# PodDisruptionBudgets of the inference pools (pruned with their pool).
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Per-job NetworkPolicies (watched for the cache; pruned when networkPolicy.enabled is turned off).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Pods: watched for failures, evictions and the trainer leader's success; a pod stuck Terminating on a
# node tainted node.kubernetes.io/out-of-service is force-deleted (operator/node_loss.py).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "delete"]
# Headless Services of pools (pruned with them), the router's and the trainer's Service.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Per-job runtime config, trainer and router identities and checkpoint volume (watched for the cache).
- apiGroups: [""]
  resources: ["configmaps", "serviceaccounts", "persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch"]
# The trainer's and the router's Role and RoleBinding (see above: no escalate/bind needed; watched for the cache).
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch"]
# Secrets: each job's engine API key is created once (never updated, listed or deleted: the garbage
# collector deletes it with its RLJob); get checks that an existing one of its name is the job's own, and
# reads the Secret a job names in spec.autotune.prometheus.bearerTokenSecretRef (docs/security.md).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
# Children carry blockOwnerDeletion: the OwnerReferencesPermissionEnforcement admission plugin lets the
# operator set it only with update on the owner's finalizers.
- apiGroups: ["rljob.io"]
  resources: ["rljobs/finalizers"]
  verbs: ["update"]
{{- end }}

{{/*
Cluster-scoped reads kopf makes: CRDs (to notice when the RLJob CRD is installed or upgraded) and, when
it is given namespaces, the namespaces themselves (to follow them being created and deleted). The
operator itself reads the Node of a pod that has been Terminating for long (is it unreachable, is it
tainted out-of-service?): get only, one node at a time.
*/}}
{{- define "rljob-operator.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["get"]
{{- end }}

{{/* The operator's ServiceAccount as an RBAC subject. */}}
{{- define "rljob-operator.subject" -}}
- kind: ServiceAccount
  name: {{ include "rljob-operator.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end }}
