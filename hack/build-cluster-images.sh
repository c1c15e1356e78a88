#!/usr/bin/env bash
# Build the images the local cluster itself runs, which no registry can give us here:
#   localhost/accelerate-operator/pause:3.10     the pod sandbox, from the pause.c that ships in the
#                                                k8s.io/kubernetes module (build/pause/linux), static
#   localhost/accelerate-operator/coredns:VER    cluster DNS: CoreDNS from the Go module proxy with
#                                                the plugins kubeadm's Corefile uses, static
# Both are single static binaries on an empty image, as upstream's are. Cached in buildah's storage
# (hack/lib/buildah.sh); a second run returns at once. Prints the two image names on stdout.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=hack/lib/buildah.sh
source "$ROOT/hack/lib/buildah.sh"
ensure_buildah

K8S_VERSION="${K8S_VERSION:-v1.34.4}"
COREDNS_VERSION="${COREDNS_VERSION:-v1.13.1}"
PAUSE_IMAGE="localhost/accelerate-operator/pause:3.10"
COREDNS_IMAGE="localhost/accelerate-operator/coredns:$COREDNS_VERSION"
WORK="$CACHE_DIR/build/cluster-images"
mkdir -p "$WORK"

have_image() { bah inspect --type image "$1" >/dev/null 2>&1; }

image_from_binary() {  # image_from_binary IMAGE BINARY ENTRYPOINT_JSON [buildah config args...]
  local image=$1 binary=$2 entrypoint=$3 ctr; shift 3
  ctr=$(bah from scratch)
  bah copy "$ctr" "$binary" "/$(basename "$binary")" >/dev/null
  bah config --entrypoint "$entrypoint" "$@" "$ctr"
  bah commit --rm "$ctr" "$image" >&2
}

if ! have_image "$PAUSE_IMAGE"; then
  echo ">> building the pause image from k8s.io/kubernetes@$K8S_VERSION" >&2
  k8s_dir=$(cd "$WORK" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" \
    | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  command -v gcc >/dev/null || { echo "error: gcc is needed for the pause image" >&2; exit 1; }
  gcc -Os -static -Wall -Werror -DVERSION="$K8S_VERSION-local" \
    -o "$WORK/pause" "$k8s_dir/build/pause/linux/pause.c"
  strip "$WORK/pause"
  image_from_binary "$PAUSE_IMAGE" "$WORK/pause" '["/pause"]' --user 65535:65535
fi

if ! have_image "$COREDNS_IMAGE"; then
  echo ">> building CoreDNS $COREDNS_VERSION from the Go module proxy (a few minutes cold)" >&2
  src="$WORK/coredns-src-$COREDNS_VERSION"  # one per version: two builds never share a folder
  mkdir -p "$src"
  # Only the plugins the Corefile needs, in CoreDNS's plugin.cfg order: building all of them
  # would download every cloud provider's SDK. client-go is pinned to the control plane's
  # version so the Go build cache from the control-plane build is reused.
  cat >"$src/main.go" <<'GO'
// Command coredns: CoreDNS with the plugins a Kubernetes cluster DNS needs.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func init() {
	dnsserver.Directives = []string{
		"reload", "ready", "health", "prometheus", "errors", "log",
		"loadbalance", "cache", "kubernetes", "loop", "forward",
	}
}

func main() { coremain.Run() }
GO
  # COREDNS_OWN_DEPENDENCIES=1 keeps CoreDNS's own client-go: an older CoreDNS (kubeadm's, for
  # the kind node image) may not build against a newer one.
  pins=""
  [[ ${COREDNS_OWN_DEPENDENCIES:-0} == 1 ]] || for m in api apimachinery client-go; do
    pins+=$'\n'"	k8s.io/$m v0.${K8S_VERSION#v1.}"
  done
  cat >"$src/go.mod" <<GOMOD
module accelerate-operator.io/coredns

go 1.24

require (
	github.com/coredns/coredns $COREDNS_VERSION$pins
)
GOMOD
  (cd "$src" && GOFLAGS=-mod=mod go mod tidy >&2 \
    && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$WORK/bin/$COREDNS_VERSION/coredns" . >&2)
  image_from_binary "$COREDNS_IMAGE" "$WORK/bin/$COREDNS_VERSION/coredns" '["/coredns"]' --user 65532:65532 --port 53/udp
fi
echo "$PAUSE_IMAGE"
echo "$COREDNS_IMAGE"
