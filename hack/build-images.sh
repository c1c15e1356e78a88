#!/usr/bin/env bash
# Build the project's container images with buildah into the project's own storage
# (hack/lib/buildah.sh), whatever else is installed: one image path, so the images are the same on
# every machine. Where they go is what the cluster needs, not which engine is on PATH:
#   the local cluster     hack/load-images.sh IMAGE...   (buildah storage -> each node's containerd)
#   kind, or any loader   hack/save-images.sh DIR IMAGE... (a docker-archive per image, for
#                         `kind load image-archive`, `docker load`, `podman load`, `ctr import`)
#   a registry            hack/push-images.sh IMAGE...   (buildah push, the engine's own login)
#
#   hack/build-images.sh                        operator, trainer-cpu and trainer-cuda
#   IMAGES="operator trainer-cpu" hack/build-images.sh
#
# Tags: $REGISTRY/operator:$TAG, $REGISTRY/trainer:$TAG-cpu, $REGISTRY/trainer:$TAG-cuda, where
# REGISTRY defaults to ghcr.io/accelerate-operator and TAG to the version in pyproject.toml: the
# names the chart and the examples use, so a cluster that has them loaded never pulls.
#
# BASES picks where the base images come from:
#   debian    (the default) one local base built from Debian's packages (hack/build-base-image.sh)
#             and torch from PyPI for both trainers, so they share every layer up to deepspeed.
#             Needs no container registry.
#   upstream  python:3.11-slim for the operator and trainer-cpu (torch from the CPU wheel index),
#             nvidia/cuda for trainer-cuda (cu128 index), pulled from their registries: what the
#             release workflow builds from.
# Needs root (or a working rootless buildah); buildah is installed with apt when missing.
# Prints the built image names on stdout.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=hack/lib/buildah.sh
source "$ROOT/hack/lib/buildah.sh"

# shellcheck source=hack/lib/images.sh
source "$ROOT/hack/lib/images.sh"
IMAGES="${IMAGES:-operator trainer-cpu trainer-cuda}"
BASES="${BASES:-debian}"
[[ -n "$TAG" ]] || { echo "build-images: no version found in pyproject.toml; set TAG" >&2; exit 1; }
ensure_buildah
bah info >/dev/null 2>&1 || { echo "build-images: 'buildah info' fails here (root, or rootless buildah with subuids, is needed)" >&2; exit 1; }
echo ">> build-images: buildah, $BASES bases" >&2

PULL=(--pull-never)
case "$BASES" in
  debian)
    base=$("$ROOT/hack/build-base-image.sh" | tail -n1)
    OPERATOR_ARGS=("PYTHON_IMAGE=$base")
    PYPI_TORCH=("BASE_IMAGE=$base" "TORCH_INDEX_URL=https://pypi.org/simple")
    CPU_ARGS=("${PYPI_TORCH[@]}" VARIANT=cpu)
    CUDA_ARGS=("${PYPI_TORCH[@]}" VARIANT=cuda)
    ;;
  upstream)
    PULL=()  # buildah's default: pull what is missing
    OPERATOR_ARGS=()
    CPU_ARGS=(VARIANT=cpu)
    CUDA_ARGS=(VARIANT=cuda "BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04"
               "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128")
    ;;
  *) echo "build-images: BASES must be debian or upstream, not '$BASES'" >&2; exit 1 ;;
esac

# RUN steps download from PyPI through whatever this host trusts: where the host's CA bundle has
# a site's own authority (a TLS-inspecting proxy), the image's stock bundle would refuse it. The
# bundle is mounted for the build only; it is not part of any layer.
HOST_CA_VOLUME=()
if [[ -s /etc/ssl/certs/ca-certificates.crt ]]; then
  HOST_CA_VOLUME=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
fi

build() { # build DOCKERFILE IMAGE [BUILD_ARG...]
  local dockerfile="$1" image="$2"; shift 2
  local args=(-f "$dockerfile" -t "$image")
  local a
  for a in "$@"; do args+=(--build-arg "$a"); done
  echo ">> build-images: $image" >&2
  # chroot isolation: RUN steps need no runtime or user namespaces, only root. Up to 3 tries: a
  # RUN step now and then fails to start ("sealing memfd copy: Device or resource busy": buildah's
  # sealed copy of itself, seen on a loaded 2-core machine with kernel 6.18 while the unit tests
  # ran beside the build), a race outside the step; a retry starts at the step that failed (the
  # layers before it are cached), and a step that truly fails fails every time.
  local try
  for try in 1 2 3; do
    if bah bud --layers --format docker --isolation chroot ${PULL[@]+"${PULL[@]}"} \
        ${HOST_CA_VOLUME[@]+"${HOST_CA_VOLUME[@]}"} "${args[@]}" . >&2; then
      echo "$image"
      return 0
    fi
    [[ $try == 3 ]] || echo ">> build-images: $image failed (try $try of 3); trying again" >&2
  done
  return 1
}

for what in $IMAGES; do
  case "$what" in
    operator) build images/operator/Dockerfile "$REGISTRY/operator:$TAG" ${OPERATOR_ARGS[@]+"${OPERATOR_ARGS[@]}"} ;;
    trainer-cpu) build images/trainer/Dockerfile "$REGISTRY/trainer:$TAG-cpu" "${CPU_ARGS[@]}" ;;
    trainer-cuda) build images/trainer/Dockerfile "$REGISTRY/trainer:$TAG-cuda" "${CUDA_ARGS[@]}" ;;
    *) echo "build-images: unknown image '$what' in IMAGES (known: operator trainer-cpu trainer-cuda)" >&2; exit 1 ;;
  esac
done
