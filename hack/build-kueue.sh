#!/usr/bin/env bash
# Build Kueue (sigs.k8s.io/kueue, cmd/kueue) from the Go module proxy into a one-binary image,
# localhost/accelerate-operator/kueue:$KUEUE_VERSION, and render its manifests from the module's
# own config/default (kustomize, through kubectl) with that image. Cached: the image in buildah's
# storage (hack/lib/buildah.sh), the manifests in $CACHE/build/kueue-$KUEUE_VERSION; a second run
# returns at once. Prints the image, then the manifests' path.
#
# Exit code 3: the module cannot be had here (the proxy refuses it). The caller decides whether
# that skips the Kueue tests; any other failure is a real one.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=hack/lib/buildah.sh
source "$ROOT/hack/lib/buildah.sh"

KUEUE_VERSION="${KUEUE_VERSION:-v0.17.0}"
IMAGE="localhost/accelerate-operator/kueue:$KUEUE_VERSION"
WORK="$CACHE_DIR/build/kueue-$KUEUE_VERSION"
MANIFESTS="$WORK/kueue.yaml"
KUBECTL="${KUBECTL:-$(command -v kubectl || echo "$CACHE_DIR/bin/v1.34.4/kubectl")}"
mkdir -p "$WORK"

have_image() { bah inspect --type image "$1" >/dev/null 2>&1; }

if have_image "$IMAGE" && [[ -s $MANIFESTS ]]; then
  echo "$IMAGE"; echo "$MANIFESTS"; exit 0
fi
ensure_buildah
command -v go >/dev/null || { echo "error: Go is needed to build Kueue" >&2; exit 1; }

echo ">> downloading sigs.k8s.io/kueue@$KUEUE_VERSION from the Go module proxy" >&2
if ! info=$(cd "$WORK" && go mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" 2>&1); then
  echo "build-kueue: the Go module proxy does not serve sigs.k8s.io/kueue@$KUEUE_VERSION:" >&2
  echo "$info" | tail -3 >&2
  exit 3
fi
src=$(python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])' <<<"$info")

if ! have_image "$IMAGE"; then
  echo ">> building kueue $KUEUE_VERSION (cmd/kueue, static)" >&2
  # The module cache is read-only: build in place with the module's own go.sum (-mod=readonly).
  (cd "$src" && CGO_ENABLED=0 go build -trimpath \
    -ldflags "-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION" \
    -o "$WORK/manager" ./cmd/kueue >&2)
  ctr=$(bah from scratch)
  bah copy "$ctr" "$WORK/manager" /manager >/dev/null
  bah config --entrypoint '["/manager"]' --user 65532:65532 "$ctr"
  bah commit --rm "$ctr" "$IMAGE" >&2
fi

echo ">> rendering Kueue's manifests (config/default) with $IMAGE" >&2
rm -rf "$WORK/config" && cp -r "$src/config" "$WORK/config" && chmod -R u+w "$WORK/config"
"$KUBECTL" kustomize "$WORK/config/default" >"$WORK/rendered.yaml"
# Our image for the manager, never pulled; anything else that would be pulled is an error.
python3 - "$WORK/rendered.yaml" "$MANIFESTS" "$IMAGE" <<'PY'
import sys, yaml
source, target, image = sys.argv[1:]
docs = [d for d in yaml.safe_load_all(open(source)) if d]
for doc in docs:
    pod = (doc.get("spec") or {}).get("template", {}).get("spec") if doc["kind"] == "Deployment" else None
    for container in (pod or {}).get("containers", []) + (pod or {}).get("initContainers", []):
        if "kueue" not in container["image"]:
            sys.exit(f"build-kueue: {doc['metadata']['name']} runs {container['image']}, not ours")
        container["image"], container["imagePullPolicy"] = image, "IfNotPresent"
yaml.safe_dump_all(docs, open(target, "w"), sort_keys=False)
PY
echo "$IMAGE"
echo "$MANIFESTS"
