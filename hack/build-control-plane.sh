#!/usr/bin/env bash
# Build pinned, real Kubernetes control-plane binaries (etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl) from the Go module proxy.
#
# The k8s.io/kubernetes module is not meant to be imported: its go.mod replaces
# every k8s.io/* staging module with a local path. We build through a small
# wrapper module whose replace lines pin each staging module to the matching
# published v0.x tag, derived from the real go.mod so the list never drifts.
#
# Binaries are cached in $CACHE_DIR/bin/<version>/ so only the first run on a
# machine compiles (about 11 minutes on 2 cores, beside the image build); later runs return
# at once.
# EXTRA_BINARIES="kubeadm" also builds kubeadm (the kind node image needs it; the local cluster
# does not).
set -euo pipefail

K8S_VERSION="${K8S_VERSION:-v1.34.4}"
ETCD_VERSION="${ETCD_VERSION:-v3.6.4}"
CACHE_DIR="${ACCELERATE_OPERATOR_CACHE:-$HOME/.cache/accelerate-operator}"
BIN_DIR="$CACHE_DIR/bin/$K8S_VERSION"
# shellcheck disable=SC2206  # EXTRA_BINARIES is a list of words
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy
          ${EXTRA_BINARIES:-})

all_present() {
  local b
  for b in "${BINARIES[@]}"; do [[ -x "$BIN_DIR/$b" ]] || return 1; done
}

if all_present; then
  echo "$BIN_DIR"
  exit 0
fi

command -v go >/dev/null || { echo "error: Go is needed to build the control plane (apt-get install golang, or https://go.dev/dl)" >&2; exit 1; }

WORK="$CACHE_DIR/build/$K8S_VERSION"
mkdir -p "$WORK" "$BIN_DIR"
cd "$WORK"

minor="${K8S_VERSION#v1.}"; minor="${minor%%.*}"
patch="${K8S_VERSION##*.}"
staging_version="v0.${minor}.${patch}"

echo ">> resolving k8s.io/kubernetes@$K8S_VERSION (staging modules at $staging_version)" >&2
k8s_dir=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')

{
  echo "module accelerate-operator.io/controlplane"
  echo
  echo "go 1.24"
  echo
  echo "require ("
  echo "  k8s.io/kubernetes $K8S_VERSION"
  echo "  go.etcd.io/etcd/server/v3 $ETCD_VERSION"
  echo ")"
  echo
  echo "replace ("
  # Every "k8s.io/x => ./staging/src/k8s.io/x" in the real go.mod becomes a pin.
  grep -E '^\s*k8s\.io/[a-z0-9-]+ => \./staging/src/' "$k8s_dir/go.mod" \
    | awk -v v="$staging_version" '{print "  " $1 " => " $1 " " v}'
  echo ")"
} > go.mod

cat > tools.go <<'GO'
//go:build tools

package controlplane

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kubeadm"
)
GO

echo ">> go mod tidy" >&2
GOFLAGS=-mod=mod go mod tidy >&2

ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

build() {  # build <binary-name> <package>
  echo ">> building $1" >&2
  CGO_ENABLED=0 go build -trimpath -tags tools -ldflags "$ldflags" -o "$BIN_DIR/$1.tmp" "$2" >&2
  mv "$BIN_DIR/$1.tmp" "$BIN_DIR/$1"
}
for b in "${BINARIES[@]}"; do
  [[ -x $BIN_DIR/$b ]] && continue
  case "$b" in
    etcd) build etcd go.etcd.io/etcd/server/v3 ;;
    *) build "$b" "k8s.io/kubernetes/cmd/$b" ;;
  esac
done

"$BIN_DIR/kube-apiserver" --version >&2
echo "$BIN_DIR"
