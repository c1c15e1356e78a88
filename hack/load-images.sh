#!/usr/bin/env bash
# Load images from buildah's storage into the containerd of every local node (what
# `kind load docker-image` does): hack/load-images.sh IMAGE...
#
# A node that already holds the same image (same buildah image ID, recorded per node) is
# skipped, so a warm run with unchanged images takes a second. Otherwise the image is exported
# once, uncompressed, and imported into all the nodes that need it at the same time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=hack/lib/buildah.sh
source "$ROOT/hack/lib/buildah.sh"
NODES_DIR="$CACHE_DIR/cluster/nodes"
NODE_RUN=/run/accelerate-operator

[[ $# -gt 0 ]] || { echo "usage: $0 IMAGE..." >&2; exit 2; }
nodes=()
for d in "$NODES_DIR"/*/; do
  [[ -S $NODE_RUN/$(basename "$d")/containerd/containerd.sock ]] && nodes+=("$(basename "$d")")
done
[[ ${#nodes[@]} -gt 0 ]] || { echo "load-images: no local node runs (hack/local-cluster.sh up)" >&2; exit 1; }

nctr() { local node=$1; shift; ctr -a "$NODE_RUN/$node/containerd/containerd.sock" -n k8s.io "$@"; }

for image in "$@"; do
  id=$(bah inspect --type image --format '{{.FromImageID}}' "$image") \
    || { echo "load-images: no image $image in buildah's storage (build it first)" >&2; exit 1; }
  stamp_name=$(tr '/:' '__' <<<"$image")
  need=()
  for node in "${nodes[@]}"; do
    stamp="$NODES_DIR/$node/images/$stamp_name"
    if [[ $(cat "$stamp" 2>/dev/null) == "$id" ]] && nctr "$node" images ls -q | grep -qxF "$image"; then
      continue
    fi
    need+=("$node")
  done
  [[ ${#need[@]} -gt 0 ]] || continue
  echo ">> load-images: $image into ${need[*]}" >&2
  archive=$(mktemp "$CACHE_DIR/image.XXXXXX.tar")
  bah push --quiet --disable-compression "$image" "oci-archive:$archive:$image" >&2
  pids=()
  for node in "${need[@]}"; do
    ( nctr "$node" images import "$archive" >/dev/null \
        && mkdir -p "$NODES_DIR/$node/images" && echo "$id" >"$NODES_DIR/$node/images/$stamp_name" ) &
    pids+=($!)
  done
  failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  rm -f "$archive"
  [[ $failed == 0 ]] || { echo "load-images: importing $image failed" >&2; exit 1; }
done
