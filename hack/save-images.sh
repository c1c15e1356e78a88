#!/usr/bin/env bash
# Write images from the project's buildah storage (hack/build-images.sh) as image archives that
# any loader takes: one docker-archive (`docker save`'s format, the image's name inside) per image.
#
#   hack/save-images.sh DIR IMAGE...      prints each archive's path on stdout, in order
#
# Then, for example:
#   kind load image-archive ARCHIVE --name CLUSTER     (kind; what hack/e2e-kind.sh does)
#   docker load -i ARCHIVE / podman load -i ARCHIVE     (another engine's storage)
#   ctr -n k8s.io images import ARCHIVE                 (a node's containerd)
# An archive whose image ID is the same as at the last save is kept, not written again.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=hack/lib/buildah.sh
source "$ROOT/hack/lib/buildah.sh"

[[ $# -ge 2 ]] || { echo "usage: $0 DIR IMAGE..." >&2; exit 2; }
dir=$1; shift
mkdir -p "$dir"
for image in "$@"; do
  id=$(bah inspect --type image --format '{{.FromImageID}}' "$image" 2>/dev/null) \
    || { echo "save-images: no image $image in buildah's storage (hack/build-images.sh builds it)" >&2; exit 1; }
  archive="$dir/$(tr '/:' '__' <<<"$image").tar"
  if [[ ! -s $archive || "$(cat "$archive.id" 2>/dev/null)" != "$id" ]]; then
    echo ">> save-images: $image -> $archive" >&2
    rm -f "$archive" "$archive.id"
    bah push --quiet "$image" "docker-archive:$archive:$image" >&2
    echo "$id" >"$archive.id"
  fi
  echo "$archive"
done
