#!/usr/bin/env bash
# End to end on a throwaway kind cluster: build the images, load them into kind, install the Helm
# chart with the built tag, run the cluster tests against it, collect logs on failure, delete the
# cluster.
#
#   hack/e2e-kind.sh [PYTEST_ARGS...]
#
# Needs a container engine kind can use (docker, or podman with KIND_EXPERIMENTAL_PROVIDER=podman),
# Go (kind is built from the Go module proxy by hack/install-tools.sh) and Python 3.
# Environment:
#   KIND_CLUSTER_NAME  cluster name (default accelerate-e2e)
#   KIND_NODE_IMAGE    node image (default kind v0.30.0's Kubernetes v1.34.0 image, by digest)
#   TAG                image tag (default the version in pyproject.toml)
#   ARTIFACTS          where logs go on failure (default a new temporary directory)
#   KEEP_CLUSTER=1     keep the cluster afterwards (to debug); SKIP_BUILD=1 reuse built images
#   KUEUE_VERSION      the Kueue release installed for tests/e2e/test_kueue.py (default v0.20.0,
#                      the newest; its release manifests are applied by hack/install-kueue.sh)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CLUSTER="${KIND_CLUSTER_NAME:-accelerate-e2e}"
NODE_IMAGE="${KIND_NODE_IMAGE:-kindest/node:v1.34.0@sha256:7416a61b42b1662ca6ca89f02028ac133a309a2a30ba309614e8ec94d976dc5a}"
# shellcheck source=hack/lib/images.sh
source "$ROOT/hack/lib/images.sh"
ARTIFACTS="${ARTIFACTS:-$(mktemp -d -t accelerate-e2e.XXXXXX)}"
RELEASE=accelerate-operator
NAMESPACE=accelerate-system
OPERATOR_IMAGE="$REGISTRY/operator:$TAG"
TRAINER_IMAGE="$REGISTRY/trainer:$TAG-cpu"

log() { echo ">> e2e-kind: $*" >&2; }
die() { echo "e2e-kind: ERROR: $*" >&2; exit 1; }

command -v kubectl >/dev/null || die "kubectl is needed on PATH"
TOOLS="$(INSTALL_TOOLS="helm kind" bash hack/install-tools.sh | tail -n1)"
export PATH="$TOOLS:$PATH"
PYTHON_ENV="$(bash hack/python-env.sh)"

mkdir -p "$ARTIFACTS"
export KUBECONFIG="$ARTIFACTS/kubeconfig"

collect_logs() {
  log "collecting logs into $ARTIFACTS"
  kind export logs "$ARTIFACTS/kind" --name "$CLUSTER" >/dev/null 2>&1 || true
  {
    kubectl get nodes -o wide
    kubectl get all,configmaps,events -A -o wide
    kubectl get acceleratejobs -A -o yaml
    kubectl describe pods -A
  } > "$ARTIFACTS/cluster-state.txt" 2>&1 || true
  kubectl -n "$NAMESPACE" logs "deploy/$RELEASE" --all-containers --previous \
    > "$ARTIFACTS/operator-previous.log" 2>&1 || true
  kubectl -n "$NAMESPACE" logs "deploy/$RELEASE" --all-containers \
    > "$ARTIFACTS/operator.log" 2>&1 || true
}

cleanup() {
  local rc=$?
  if [[ $rc != 0 ]]; then
    collect_logs
    log "FAILED (exit $rc); logs are in $ARTIFACTS"
  fi
  if [[ "${KEEP_CLUSTER:-0}" == 1 ]]; then
    log "keeping cluster $CLUSTER (KUBECONFIG=$KUBECONFIG); delete it with: kind delete cluster --name $CLUSTER"
  else
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  fi
  exit "$rc"
}

if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  log "building $OPERATOR_IMAGE and $TRAINER_IMAGE"
  IMAGES="operator trainer-cpu" TAG="$TAG" REGISTRY="$REGISTRY" bash hack/build-images.sh >/dev/null
fi

log "creating kind cluster $CLUSTER ($NODE_IMAGE)"
kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
trap cleanup EXIT
kind create cluster --name "$CLUSTER" --image "$NODE_IMAGE" --kubeconfig "$KUBECONFIG" --wait 180s

log "loading images into the cluster"
if [[ "${KIND_EXPERIMENTAL_PROVIDER:-docker}" == podman ]]; then
  for image in "$OPERATOR_IMAGE" "$TRAINER_IMAGE"; do
    archive="$ARTIFACTS/$(basename "${image//:/_}").tar"
    podman save -o "$archive" "$image"
    kind load image-archive "$archive" --name "$CLUSTER"
    rm -f "$archive"
  done
else
  kind load docker-image "$OPERATOR_IMAGE" "$TRAINER_IMAGE" --name "$CLUSTER"
fi

export KUEUE_VERSION="${KUEUE_VERSION:-v0.20.0}"
log "installing Kueue $KUEUE_VERSION"
ACCELERATE_OPERATOR_EXTERNAL_CLUSTER=1 bash hack/install-kueue.sh

log "installing the chart"
# pullPolicy Never: the images exist only inside the kind node, loaded above. Progress written
# every 2 s (the default is 10 s): no test waits the interval out.
helm upgrade --install "$RELEASE" charts/accelerate-operator \
  --namespace "$NAMESPACE" --create-namespace \
  --set image.repository="$REGISTRY/operator" \
  --set image.tag="$TAG" \
  --set image.pullPolicy=Never \
  --set logLevel=debug \
  --set kueue.enabled=true \
  --set reports.progressWriteSeconds=2 \
  --wait --timeout 5m
kubectl -n "$NAMESPACE" rollout status "deploy/$RELEASE" --timeout=120s

log "running the cluster tests"
ACCELERATE_OPERATOR_EXTERNAL_CLUSTER=1 \
ACCELERATE_OPERATOR_TRAINER_IMAGE="$TRAINER_IMAGE" \
ACCELERATE_OPERATOR_NAMESPACE="$NAMESPACE" \
  "$PYTHON_ENV/bin/python" -m pytest tests/integration tests/e2e -m cluster -p no:cacheprovider \
    --junitxml="$ARTIFACTS/junit.xml" "$@"
log "passed"
