#!/usr/bin/env bash
# Load images from buildah's storage into the containerd of every local node (what
# `kind load docker-image` does): hack/load-images.sh IMAGE...
#
# A node that already holds the same image (same buildah image ID, recorded per node) is
# skipped, so a warm run with unchanged images takes a second. Otherwise the image is pushed,
# uncompressed, into an OCI layout kept in the cache (only new layers are written), and each node
# that needs it imports a stream of just the layers its containerd lacks: after a code change
# that is the few megabytes of the code layer, not the gigabytes of torch.
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
    if [[ $(cat "$stamp" 2>/dev/null) == "$id" ]] && nctr "$node" images ls -q | grep -xF "$image" >/dev/null; then
      continue
    fi
    need+=("$node")
  done
  [[ ${#need[@]} -gt 0 ]] || continue
  echo ">> load-images: $image into ${need[*]}" >&2
  # One layout per repository, not per tag: another tag of the same image (the upgrade e2e's
  # previous trainer, say) shares its gigabytes of base layers, and the push writes only the rest.
  layout="$CACHE_DIR/oci/$(tr '/:' '__' <<<"${image%:*}")"
  rm -rf "$layout/index.json"  # one image per push: the index names only this one
  mkdir -p "$layout"
  bah push --quiet --disable-compression "$image" "oci:$layout:$image" >&2
  # Blobs the layout holds from older pushes that this image no longer uses are dropped.
  python3 - "$layout" <<'PY'
import json, os, sys
root = sys.argv[1]
blob = lambda d: os.path.join(root, "blobs", *d.split(":"))
keep = set()
for m in json.load(open(os.path.join(root, "index.json")))["manifests"]:
    keep.add(m["digest"])
    manifest = json.load(open(blob(m["digest"])))
    keep.update(d["digest"] for d in [manifest["config"], *manifest["layers"]])
folder = os.path.join(root, "blobs", "sha256")
for name in os.listdir(folder):
    if f"sha256:{name}" not in keep:
        os.remove(os.path.join(folder, name))
PY
  pids=()
  for node in "${need[@]}"; do
    (
      have=$(nctr "$node" content ls -q 2>/dev/null | sed 's/^sha256://')
      cd "$layout"
      files=(oci-layout index.json)
      for f in blobs/sha256/*; do
        grep -qxF "$(basename "$f")" <<<"$have" || files+=("$f")
      done
      # A node may keep a layer's blob but not its unpacked snapshot (the kubelet's image GC
      # removed an older image): the import then fails on a missing parent. Send every blob.
      tar -cf - "${files[@]}" | nctr "$node" images import - >/dev/null \
        || tar -cf - oci-layout index.json blobs | nctr "$node" images import - >/dev/null
      mkdir -p "$NODES_DIR/$node/images"
      echo "$id" >"$NODES_DIR/$node/images/$stamp_name"
    ) &
    pids+=($!)
  done
  failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  [[ $failed == 0 ]] || { echo "load-images: importing $image failed" >&2; exit 1; }
done
