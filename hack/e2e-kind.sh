#!/usr/bin/env bash
# End to end on a throwaway kind cluster: build the images, create the cluster (a control plane
# and two workers, hack/kind/cluster.yaml), load the images into its nodes, install the operator
# with the Helm chart (hack/deploy-operator.sh, as on the local cluster), run the cluster tests
# against it, collect logs on failure, delete the cluster.
#
#   hack/e2e-kind.sh [PYTEST_ARGS...]    (no arguments: tests/integration and tests/e2e, -m cluster)
#
# Where the nodes come from (KIND_NODE_IMAGE):
#   released  kind's released node image, pulled by digest, run by the Docker engine of
#             DOCKER_HOST. The default where `docker info` answers (a hosted CI runner).
#   local     a node image built here from our own binaries (hack/build-kind-node.sh), run by a
#             Docker engine built from source beside anything installed (hack/kind-docker.sh),
#             whose privileged containers work without CAP_SYS_RESOURCE. The default where no
#             Docker engine answers; needs root, Go and Debian's apt (our machines).
#   IMAGE     any other node image.
# Needs Go (kind is built from the Go module proxy by hack/install-tools.sh) and Python 3.
# Environment:
#   KIND_CLUSTER_NAME  cluster name (default accelerate-e2e)
#   TAG                image tag (default the version in pyproject.toml)
#   ARTIFACTS          where logs, the JUnit report and step timings go (default a temporary dir)
#   IMAGES             the images built and loaded (default "operator trainer-cpu"; "operator"
#                      is enough for the tests that train nothing, tests/integration)
#   KEEP_CLUSTER=1     keep the cluster afterwards (to debug); SKIP_BUILD=1 reuse built images
#   KUEUE_FROM         where tests/e2e/test_kueue.py's Kueue comes from: "release" (its release
#                      manifests and registry.k8s.io image; the default with the released node
#                      image) or "source" (hack/build-kueue.sh from the Go module proxy, loaded
#                      into the workers; the default with the local one: no registry here)
# Kueue is not installed here: tests/e2e/test_kueue.py installs it (hack/install-kueue.sh) and
# removes it again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CLUSTER="${KIND_CLUSTER_NAME:-accelerate-e2e}"
RELEASED_NODE_IMAGE="kindest/node:v1.34.0@sha256:7416a61b42b1662ca6ca89f02028ac133a309a2a30ba309614e8ec94d976dc5a"
# shellcheck source=hack/lib/images.sh
source "$ROOT/hack/lib/images.sh"
# shellcheck source=hack/lib/buildah.sh
source "$ROOT/hack/lib/buildah.sh"
ARTIFACTS="${ARTIFACTS:-$(mktemp -d -t accelerate-e2e.XXXXXX)}"
NAMESPACE=accelerate-system
TRAINER_IMAGE="$REGISTRY/trainer:$TAG-cpu"
IMAGES="${IMAGES:-operator trainer-cpu}"
IMAGE_REFS=()
for image in $IMAGES; do
  case "$image" in
    operator) IMAGE_REFS+=("$REGISTRY/operator:$TAG") ;;
    trainer-cpu) IMAGE_REFS+=("$TRAINER_IMAGE") ;;
    *) echo "e2e-kind: ERROR: IMAGES: no '$image' (known: operator trainer-cpu)" >&2; exit 1 ;;
  esac
done

log() { echo ">> e2e-kind: $(date +%T) $*" >&2; }
die() { echo "e2e-kind: ERROR: $*" >&2; exit 1; }
STEP_STARTED=$SECONDS
step_done() {  # step_done NAME: the seconds since the last step, logged and kept in timings.txt
  echo "$1 $((SECONDS - STEP_STARTED))" >>"$ARTIFACTS/timings.txt"
  log "$1 took $((SECONDS - STEP_STARTED))s"
  STEP_STARTED=$SECONDS
}

mkdir -p "$ARTIFACTS" /tmp/accelerate-operator-shared  # the workers' shared folder (hack/kind/cluster.yaml)
: >"$ARTIFACTS/timings.txt"
TOOLS="$(INSTALL_TOOLS="helm kind" bash hack/install-tools.sh | tail -n1)"
export PATH="$TOOLS:$PATH"
# kubectl: the one on PATH (a CI runner's), else ours (hack/build-control-plane.sh, cached).
command -v kubectl >/dev/null || PATH="$(hack/build-control-plane.sh | tail -n1):$PATH"
PYTHON_ENV="$(bash hack/python-env.sh)"
export KUBECONFIG="$ARTIFACTS/kubeconfig"

# Before DOCKER_HOST may name our own engine below: build-images.sh must not take that for one
# to build with.
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  log "building $IMAGES"
  IMAGES="$IMAGES" TAG="$TAG" REGISTRY="$REGISTRY" bash hack/build-images.sh >/dev/null
  step_done build-images
fi

NODE_IMAGE="${KIND_NODE_IMAGE:-}"
if [[ -z $NODE_IMAGE ]]; then
  if docker info >/dev/null 2>&1; then NODE_IMAGE=released; else NODE_IMAGE=local; fi
fi
case "$NODE_IMAGE" in
  released) NODE_IMAGE="$RELEASED_NODE_IMAGE" ;;
  local)
    : "${KUEUE_FROM:=source}"
    log "no usable Docker engine for kind here: starting our own (hack/kind-docker.sh)"
    DOCKER_HOST="$(hack/kind-docker.sh up | tail -n1)"
    export DOCKER_HOST
    NODE_IMAGE="$(hack/build-kind-node.sh | tail -n1)"
    step_done node-image
    ;;
esac

collect_logs() {
  log "collecting logs into $ARTIFACTS"
  kind export logs "$ARTIFACTS/kind" --name "$CLUSTER" >/dev/null 2>&1 || true
  {
    kubectl get nodes -o wide
    kubectl get all,configmaps,events -A -o wide
    kubectl get acceleratejobs -A -o yaml
    kubectl describe pods -A
  } >"$ARTIFACTS/cluster-state.txt" 2>&1 || true
  kubectl -n "$NAMESPACE" logs deploy/accelerate-operator --all-containers --previous \
    >"$ARTIFACTS/operator-previous.log" 2>&1 || true
  kubectl -n "$NAMESPACE" logs deploy/accelerate-operator --all-containers \
    >"$ARTIFACTS/operator.log" 2>&1 || true
}

cleanup() {
  local rc=$?
  if [[ $rc != 0 ]]; then
    collect_logs
    log "FAILED (exit $rc); logs are in $ARTIFACTS"
  fi
  if [[ "${KEEP_CLUSTER:-0}" == 1 ]]; then
    log "keeping cluster $CLUSTER: export KUBECONFIG=$KUBECONFIG${DOCKER_HOST:+ DOCKER_HOST=$DOCKER_HOST}; delete it with: kind delete cluster --name $CLUSTER"
  else
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  fi
  exit "$rc"
}

# load IMAGE...: into the workers, from the engine that built them: docker, or buildah's storage
# through an OCI archive, which `kind load image-archive` takes. Its layers are compressed (a
# quarter of the size for our images): each node keeps the archive's blobs beside the unpacked
# layers.
load() {
  local image archive workers
  workers=$(kind get nodes --name "$CLUSTER" | grep -v control-plane | paste -sd, -)
  for image in "$@"; do
    if docker image inspect "$image" >/dev/null 2>&1; then
      kind load docker-image "$image" --name "$CLUSTER" --nodes "$workers"
    elif bah inspect --type image "$image" >/dev/null 2>&1; then
      archive="$(mktemp -d)/image.tar"
      bah push --quiet "$image" "oci-archive:$archive:$image" >&2
      kind load image-archive "$archive" --name "$CLUSTER" --nodes "$workers"
      rm -rf "$(dirname "$archive")"
    else
      die "no image $image in docker or buildah; build it (hack/build-images.sh)"
    fi
  done
}

log "creating kind cluster $CLUSTER ($NODE_IMAGE)"
kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
trap cleanup EXIT
kind create cluster --name "$CLUSTER" --image "$NODE_IMAGE" --config hack/kind/cluster.yaml \
  --kubeconfig "$KUBECONFIG" --wait 300s
step_done create-cluster

log "loading the images into the workers"
load "${IMAGE_REFS[@]}"
step_done load-images

if [[ ${KUEUE_FROM:-release} == source ]]; then
  log "building Kueue from the Go module proxy (hack/build-kueue.sh) and loading it"
  kueue="$(hack/build-kueue.sh)"
  load "$(sed -n 1p <<<"$kueue")"
  KUEUE_MANIFESTS="$(sed -n 2p <<<"$kueue")"
  export KUEUE_MANIFESTS  # hack/install-kueue.sh applies these instead of the release's
  step_done load-kueue
fi

log "installing the operator with the chart"
export ACCELERATE_OPERATOR_NAMESPACE="$NAMESPACE"
export ACCELERATE_OPERATOR_HELM_ARGS="--set image.pullPolicy=Never --set logLevel=debug"
hack/deploy-operator.sh
step_done install-chart

log "running the cluster tests"
[[ $# -gt 0 ]] || set -- tests/integration tests/e2e -m cluster
ACCELERATE_OPERATOR_EXTERNAL_CLUSTER=1 ACCELERATE_OPERATOR_TRAINER_IMAGE="$TRAINER_IMAGE" \
  "$PYTHON_ENV/bin/python" -m pytest -p no:cacheprovider --junitxml="$ARTIFACTS/junit.xml" \
  --durations=30 "$@"
step_done tests
log "passed"
