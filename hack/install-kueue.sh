#!/usr/bin/env bash
# Install Kueue (hack/build-kueue.sh) on the cluster of $KUBECONFIG: load its image into the local
# nodes, apply its manifests server-side, and wait until its webhooks answer. Kueue manages its
# webhook certificate itself (internalCertManagement): no cert-manager. The API server calls the
# webhooks at their endpoints' pod IPs (--enable-aggregator-routing, hack/local-cluster.sh): it
# runs on the host, which routes pod IPs but not Service ClusterIPs.
# On an external cluster (kind: ACCELERATE_OPERATOR_EXTERNAL_CLUSTER=1) Kueue's release manifests
# are applied instead: the newest release by default (KUEUE_VERSION, v0.20.0: v1beta2 only), or
# KUEUE_MANIFESTS (hack/e2e-kind.sh sets them to hack/build-kueue.sh's where no registry answers).
# Then Kueue's read access to AccelerateJobs (hack/kueue-acceleratejob-rbac.yaml, docs/kueue.md).
# Idempotent; exit code 3 passes on build-kueue.sh's "Kueue cannot be had here".
# `--uninstall` removes it all again: Kueue's default webhooks fail closed on every pod and
# Deployment outside kube-system, so a Kueue left behind whose controller is down (it exits when
# it loses its leader lease, e.g. across an API server restart) blocks the pods of every job.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${KUBECONFIG:?set KUBECONFIG to the kubeconfig of the cluster}"
KUBECTL="${KUBECTL:-$(command -v kubectl || echo "${ACCELERATE_OPERATOR_CACHE:-$HOME/.cache/accelerate-operator}/bin/v1.34.4/kubectl")}"

if [[ ${1:-} == --uninstall ]]; then
  # Everything Kueue's manifests create carries this label; the webhooks go first, so nothing
  # waits on a webhook whose controller is being deleted.
  selector=app.kubernetes.io/name=kueue
  "$KUBECTL" delete mutatingwebhookconfigurations,validatingwebhookconfigurations,apiservices \
    -l "$selector" --ignore-not-found >&2
  "$KUBECTL" delete -f "$ROOT/hack/kueue-acceleratejob-rbac.yaml" --ignore-not-found >&2
  "$KUBECTL" delete namespace kueue-system --ignore-not-found --timeout=180s >&2
  # Kueue's objects left (a ResourceFlavor or ClusterQueue still in use) keep finalizers only
  # its controller, gone now, would remove; their CRDs would never go. Drop the finalizers.
  for crd in $("$KUBECTL" get customresourcedefinitions -l "$selector" -o name); do
    resource=${crd#*/}
    "$KUBECTL" get "$resource" --all-namespaces --no-headers \
      -o custom-columns=NS:.metadata.namespace,NAME:.metadata.name 2>/dev/null |
    while read -r ns name; do
      scope=(); [[ $ns == "<none>" ]] || scope=(-n "$ns")
      "$KUBECTL" "${scope[@]}" patch "$resource" "$name" --type=merge \
        -p '{"metadata":{"finalizers":null}}' >/dev/null || true
    done
  done
  "$KUBECTL" delete customresourcedefinitions,clusterroles,clusterrolebindings -l "$selector" \
    --ignore-not-found --timeout=180s >&2
  echo ">> Kueue uninstalled" >&2
  exit 0
fi

if [[ ${ACCELERATE_OPERATOR_EXTERNAL_CLUSTER:-0} == 1 ]]; then
  # kind and other clusters that pull images: Kueue's own release manifests and image.
  version="${KUEUE_VERSION:-v0.20.0}"
  manifests="${KUEUE_MANIFESTS:-https://github.com/kubernetes-sigs/kueue/releases/download/$version/manifests.yaml}"
else
  set +e
  out=$("$ROOT/hack/build-kueue.sh")
  rc=$?
  set -e
  [[ $rc -eq 0 ]] || exit "$rc"
  manifests=$(sed -n 2p <<<"$out")
  "$ROOT/hack/load-images.sh" "$(sed -n 1p <<<"$out")" >&2
fi
echo ">> applying Kueue ($manifests)" >&2
"$KUBECTL" apply --server-side --force-conflicts -f "$manifests" >&2
"$KUBECTL" -n kueue-system rollout status deployment/kueue-controller-manager --timeout=300s >&2

"$KUBECTL" apply --server-side -f "$ROOT/hack/kueue-acceleratejob-rbac.yaml" >&2

# The version Kueue serves: v1beta2 from v0.15 (the only one from v0.20), else v1beta1 (as the
# operator chooses, kueue/workload.py choose_kueue_version).
if "$KUBECTL" get --raw /apis/kueue.x-k8s.io | grep -q '"version":"v1beta2"'; then
  api=kueue.x-k8s.io/v1beta2
else
  api=kueue.x-k8s.io/v1beta1
fi
echo ">> Kueue serves $api" >&2

# Ready when its validating webhook answers a server-side dry run.
flavor='{"apiVersion":"'"$api"'","kind":"ResourceFlavor","metadata":{"name":"install-check"}}'
for _ in $(seq 1 90); do
  if "$KUBECTL" apply --dry-run=server -f - <<<"$flavor" >/dev/null 2>&1; then
    echo ">> Kueue's webhooks answer" >&2
    exit 0
  fi
  sleep 2
done
"$KUBECTL" apply --dry-run=server -f - <<<"$flavor" >&2 || true
echo "install-kueue: Kueue's webhooks did not answer in 180s" >&2
exit 1
