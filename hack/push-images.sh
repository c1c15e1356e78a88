#!/usr/bin/env bash
# Push images from the project's buildah storage (hack/build-images.sh) to the registry their
# names say: `REGISTRY=registry.example.com/ml make images`, then
#
#   hack/push-images.sh IMAGE...
#
# Credentials are buildah's: `buildah login REGISTRY`, or a docker/podman login already made
# (buildah reads their auth files too).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=hack/lib/buildah.sh
source "$ROOT/hack/lib/buildah.sh"

[[ $# -ge 1 ]] || { echo "usage: $0 IMAGE..." >&2; exit 2; }
for image in "$@"; do
  echo ">> push-images: $image" >&2
  bah push "$image" "docker://$image" >&2
done
