#!/usr/bin/env bash
# Build the project's container images with whichever engine works here: docker (with a running
# daemon), podman or buildah, in that order.
#
#   hack/build-images.sh                        operator, trainer-cpu and trainer-cuda
#   IMAGES="operator trainer-cpu" hack/build-images.sh
#
# Tags: $REGISTRY/operator:$TAG, $REGISTRY/trainer:$TAG-cpu, $REGISTRY/trainer:$TAG-cuda, where
# REGISTRY defaults to ghcr.io/accelerate-operator and TAG to the version in pyproject.toml.
# ENGINE=docker|podman|buildah forces an engine. Prints the built image names on stdout.
# Exits 1 with a message when no engine works (a docker CLI without a daemon does not count).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

REGISTRY="${REGISTRY:-ghcr.io/accelerate-operator}"
TAG="${TAG:-$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n1)}"
IMAGES="${IMAGES:-operator trainer-cpu trainer-cuda}"
[[ -n "$TAG" ]] || { echo "build-images: no version found in pyproject.toml; set TAG" >&2; exit 1; }

engine_works() {
  case "$1" in
    docker) command -v docker >/dev/null && docker info >/dev/null 2>&1 ;;
    podman) command -v podman >/dev/null && podman info >/dev/null 2>&1 ;;
    buildah) command -v buildah >/dev/null && buildah info >/dev/null 2>&1 ;;
    *) return 1 ;;
  esac
}

if [[ -n "${ENGINE:-}" ]]; then
  engine_works "$ENGINE" || { echo "build-images: ENGINE=$ENGINE does not work here ('$ENGINE info' fails)" >&2; exit 1; }
else
  for candidate in docker podman buildah; do
    if engine_works "$candidate"; then ENGINE="$candidate"; break; fi
  done
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
echo ">> build-images: using $ENGINE" >&2

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
    buildah) buildah bud --layers "${args[@]}" . >&2 ;;
  esac
  echo "$image"
}

for what in $IMAGES; do
  case "$what" in
    operator) build images/operator/Dockerfile "$REGISTRY/operator:$TAG" ;;
    trainer-cpu) build images/trainer/Dockerfile "$REGISTRY/trainer:$TAG-cpu" VARIANT=cpu ;;
    trainer-cuda) build images/trainer/Dockerfile "$REGISTRY/trainer:$TAG-cuda" VARIANT=cuda ;;
    *) echo "build-images: unknown image '$what' in IMAGES (known: operator trainer-cpu trainer-cuda)" >&2; exit 1 ;;
  esac
done
