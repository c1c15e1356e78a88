#!/usr/bin/env bash
# Build the project's container images with whichever engine works here: docker (with a running
# daemon), podman or buildah, in that order.
#
#   hack/build-images.sh                        operator, trainer-cpu and trainer-cuda
#   IMAGES="operator trainer-cpu" hack/build-images.sh
#
# Tags: $REGISTRY/operator:$TAG, $REGISTRY/trainer:$TAG-cpu, $REGISTRY/trainer:$TAG-cuda, where
# REGISTRY defaults to ghcr.io/accelerate-operator and TAG to the version in pyproject.toml: the
# names the chart and the examples use, so a cluster that has them loaded never pulls.
#
# BASES picks where the base images come from:
#   upstream  python:3.11-slim for the operator and trainer-cpu (torch from the CPU wheel index),
#             nvidia/cuda for trainer-cuda (cu128 index): needs a registry. Default with docker/podman.
#   debian    one local base built from Debian's packages (hack/build-base-image.sh) and torch from
#             PyPI for both trainers, so they share every layer up to deepspeed. Needs no registry;
#             the default with buildah, which is what our machines and CI have.
# ENGINE=docker|podman|buildah forces an engine. Prints the built image names on stdout.
# Exits 1 with a message when no engine works (a docker CLI without a daemon does not count).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck source=hack/lib/buildah.sh
source "$ROOT/hack/lib/buildah.sh"

# shellcheck source=hack/lib/images.sh
source "$ROOT/hack/lib/images.sh"
IMAGES="${IMAGES:-operator trainer-cpu trainer-cuda}"
[[ -n "$TAG" ]] || { echo "build-images: no version found in pyproject.toml; set TAG" >&2; exit 1; }

engine_works() {
  case "$1" in
    docker) command -v docker >/dev/null && docker info >/dev/null 2>&1 ;;
    podman) command -v podman >/dev/null && podman info >/dev/null 2>&1 ;;
    buildah) command -v buildah >/dev/null && bah info >/dev/null 2>&1 ;;
    *) return 1 ;;
  esac
}

if [[ -n "${ENGINE:-}" ]]; then
  [[ $ENGINE == buildah ]] && ensure_buildah
  engine_works "$ENGINE" || { echo "build-images: ENGINE=$ENGINE does not work here ('$ENGINE info' fails)" >&2; exit 1; }
else
  for candidate in docker podman buildah; do
    if engine_works "$candidate"; then ENGINE="$candidate"; break; fi
  done
  if [[ -z "${ENGINE:-}" && $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
    ensure_buildah && engine_works buildah && ENGINE=buildah
  fi
fi
if [[ -z "${ENGINE:-}" ]]; then
  {
    echo "build-images: no working container engine found."
    command -v docker >/dev/null && echo "  docker: the CLI is installed but 'docker info' fails (is the daemon running, may you use its socket?)"
    command -v podman >/dev/null && echo "  podman: installed but 'podman info' fails"
    command -v buildah >/dev/null && echo "  buildah: installed but 'buildah info' fails"
    echo "Start a Docker daemon, or install podman or buildah, then run this again."
  } >&2
  exit 1
fi
BASES="${BASES:-$([[ $ENGINE == buildah ]] && echo debian || echo upstream)}"
echo ">> build-images: using $ENGINE, $BASES bases" >&2

case "$BASES" in
  debian)
    if [[ $ENGINE != buildah ]]; then
      echo "build-images: BASES=debian needs ENGINE=buildah (the base is built into its storage)" >&2
      exit 1
    fi
    base=$("$ROOT/hack/build-base-image.sh" | tail -n1)
    OPERATOR_ARGS=("PYTHON_IMAGE=$base")
    PYPI_TORCH=("BASE_IMAGE=$base" "TORCH_INDEX_URL=https://pypi.org/simple")
    CPU_ARGS=("${PYPI_TORCH[@]}" VARIANT=cpu)
    CUDA_ARGS=("${PYPI_TORCH[@]}" VARIANT=cuda)
    ;;
  upstream)
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
if [[ $ENGINE == buildah && -s /etc/ssl/certs/ca-certificates.crt ]]; then
  HOST_CA_VOLUME=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
fi

build() { # build DOCKERFILE IMAGE [BUILD_ARG...]
  local dockerfile="$1" image="$2"; shift 2
  local args=(-f "$dockerfile" -t "$image")
  local a
  for a in "$@"; do args+=(--build-arg "$a"); done
  echo ">> build-images: $image" >&2
  case "$ENGINE" in
    # BuildKit builds only the stage the trainer's VARIANT selects.
    docker) DOCKER_BUILDKIT=1 docker build "${args[@]}" . >&2 ;;
    podman) podman build --layers "${args[@]}" . >&2 ;;
    # chroot isolation: RUN steps need no runtime or user namespaces, only root.
    buildah) bah bud --layers --format docker --isolation chroot --pull-never ${HOST_CA_VOLUME[@]+"${HOST_CA_VOLUME[@]}"} \
               "${args[@]}" . >&2 ;;
  esac
  echo "$image"
}

for what in $IMAGES; do
  case "$what" in
    operator) build images/operator/Dockerfile "$REGISTRY/operator:$TAG" ${OPERATOR_ARGS[@]+"${OPERATOR_ARGS[@]}"} ;;
    trainer-cpu) build images/trainer/Dockerfile "$REGISTRY/trainer:$TAG-cpu" "${CPU_ARGS[@]}" ;;
    trainer-cuda) build images/trainer/Dockerfile "$REGISTRY/trainer:$TAG-cuda" "${CUDA_ARGS[@]}" ;;
    *) echo "build-images: unknown image '$what' in IMAGES (known: operator trainer-cpu trainer-cuda)" >&2; exit 1 ;;
  esac
done
