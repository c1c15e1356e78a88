#!/usr/bin/env bash
# Install or upgrade the operator in the cluster of $KUBECONFIG with the Helm chart, and wait until
# it runs. On the local cluster the image is rebuilt from this checkout under the same tag, so a
# hash of the code and its Dockerfile is a pod annotation: a change rolls the operator, an
# unchanged checkout leaves it alone. The Kueue integration is on when the cluster serves Kueue's
# Workloads (hack/install-kueue.sh); it acts only on jobs labelled kueue.x-k8s.io/queue-name.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
: "${KUBECONFIG:?set KUBECONFIG to the kubeconfig of the cluster}"
export KUBECONFIG

NAMESPACE="${ACCELERATE_OPERATOR_NAMESPACE:-accelerate-system}"
RELEASE="${ACCELERATE_OPERATOR_RELEASE:-accelerate-operator}"
HELM="$(hack/install-tools.sh | tail -n1)/helm"
CRD=acceleratejobs.accelerate-operator.io

code_files() {
  find operator trainer crds charts images/operator pyproject.toml -type f \
    \( -name '*.py' -o -name '*.yaml' -o -name '*.toml' -o -name '*.tpl' -o -name '*.json' \
       -o -name Dockerfile \) -print0
}
# With the local image's own ID: a deploy run before the image was rebuilt from changed code
# (the Kueue tests deploy again, for one) must not leave the pods on the stale image for good.
local_image_id() {
  command -v buildah >/dev/null || return 0
  # shellcheck source=hack/lib/buildah.sh
  source "$ROOT/hack/lib/buildah.sh"
  # shellcheck source=hack/lib/images.sh
  source "$ROOT/hack/lib/images.sh"
  bah images --noheading --format '{{.ID}}' "$REGISTRY/operator:$TAG" 2>/dev/null || true
}
code_hash=$( { code_files | sort -z | xargs -0 sha256sum; local_image_id; } | sha256sum | cut -c1-16)

# A CRD applied by hand before (kubectl apply -f crds/) is adopted rather than refused.
owner_path='{.metadata.annotations.meta\.helm\.sh/release-name}'
if kubectl get crd "$CRD" >/dev/null 2>&1; then
  owner=$(kubectl get crd "$CRD" -o jsonpath="$owner_path")
  if [[ -z "$owner" ]]; then
    kubectl label crd "$CRD" app.kubernetes.io/managed-by=Helm --overwrite >/dev/null
    kubectl annotate crd "$CRD" meta.helm.sh/release-name="$RELEASE" \
      meta.helm.sh/release-namespace="$NAMESPACE" --overwrite >/dev/null
  fi
fi

# One deploy at a time on this machine (parallel test sessions share the local cluster).
lock_dir="${ACCELERATE_OPERATOR_CACHE:-$HOME/.cache/accelerate-operator}"
mkdir -p "$lock_dir"
exec 9>"$lock_dir/deploy-operator.lock"
flock 9

# A release left pending by an interrupted helm (the API server restarted under it) blocks every
# later upgrade with "another operation is in progress": roll it back, or remove a failed install.
status=$("$HELM" status "$RELEASE" -n "$NAMESPACE" -o json 2>/dev/null \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["info"]["status"])' 2>/dev/null || true)
case "$status" in
  pending-install) "$HELM" uninstall "$RELEASE" -n "$NAMESPACE" --wait >&2 ;;
  pending-*) "$HELM" rollback "$RELEASE" -n "$NAMESPACE" --wait >&2 ;;
esac

kueue_enabled=false
if kubectl get crd workloads.kueue.x-k8s.io >/dev/null 2>&1; then kueue_enabled=true; fi
# The tests' operator writes a job's progress every 2 s (the chart's default is 12 s), so no test
# waits the interval out; bench/run.sh deploys with the default it measures.
progress_write_seconds="${ACCELERATE_OPERATOR_PROGRESS_WRITE_SECONDS:-2}"
echo ">> helm upgrade --install $RELEASE (namespace $NAMESPACE, code $code_hash)" >&2
"$HELM" upgrade --install "$RELEASE" charts/accelerate-operator \
  --namespace "$NAMESPACE" --create-namespace --force-conflicts \
  --set-string "podAnnotations.accelerate-operator\.io/code-hash=$code_hash" \
  --set "kueue.enabled=$kueue_enabled" \
  --set "reports.progressWriteSeconds=$progress_write_seconds" \
  ${ACCELERATE_OPERATOR_HELM_ARGS:-} \
  --wait --timeout 180s >&2
kubectl wait --for=condition=Established "crd/$CRD" --timeout=60s >/dev/null
kubectl -n "$NAMESPACE" rollout status deployment -l app.kubernetes.io/name=accelerate-operator --timeout=120s >&2
