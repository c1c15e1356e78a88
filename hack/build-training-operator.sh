#!/usr/bin/env bash
# Build Kubeflow's Go training-operator (the PyTorchJob controller among others) from the Go
# module proxy, for bench/kubeflow_compare.py: our operator and the Go one side by side on the
# same cluster.
#
# github.com/kubeflow/training-operator has no replace directives, so `go install pkg@version`
# builds it exactly as its go.mod/go.sum pin it. The binary and the CRD/RBAC manifests of that
# version are cached in $CACHE_DIR/build/training-operator-<version>/: only the first run compiles
# (as upstream's Dockerfile does: CGO_ENABLED=0, no ldflags; about 5 minutes on 2 busy cores at
# nice 10, dependency downloads included); later runs return at once.
#
# Prints, last line, the binary's path; the line before it, the manifests folder
# (crds/kubeflow.org_pytorchjobs.yaml, rbac/role.yaml, ... as in the module's manifests/base).
#
#   TRAINING_OPERATOR_VERSION=v1.9.4 hack/build-training-operator.sh
set -euo pipefail

MODULE=github.com/kubeflow/training-operator
VERSION="${TRAINING_OPERATOR_VERSION:-v1.9.4}"
CACHE_DIR="${ACCELERATE_OPERATOR_CACHE:-$HOME/.cache/accelerate-operator}"
WORK="$CACHE_DIR/build/training-operator-$VERSION"
BIN="$WORK/bin/training-operator"
MANIFESTS="$WORK/manifests"

if [[ -x $BIN && -f $MANIFESTS/crds/kubeflow.org_pytorchjobs.yaml ]]; then
  echo "$MANIFESTS"
  echo "$BIN"
  exit 0
fi

command -v go >/dev/null || { echo "error: Go is needed to build the training-operator" >&2; exit 1; }
mkdir -p "$WORK/bin"
# One Go build at a time on this small machine: a second caller waits for the first.
exec 9>"$WORK/.lock"
flock 9
if [[ -x $BIN && -f $MANIFESTS/crds/kubeflow.org_pytorchjobs.yaml ]]; then
  echo "$MANIFESTS"
  echo "$BIN"
  exit 0
fi

echo ">> downloading $MODULE@$VERSION through $(go env GOPROXY | cut -d, -f1)" >&2
dir=$(go mod download -json "$MODULE@$VERSION" |
      sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
[[ -n $dir && -d $dir ]] || { echo "error: could not download $MODULE@$VERSION" >&2; exit 1; }

started=$SECONDS
echo ">> building $MODULE/cmd/training-operator.v1@$VERSION (CGO_ENABLED=0, nice 10)" >&2
CGO_ENABLED=0 GOBIN="$WORK/bin" GOFLAGS="-buildvcs=false" \
  nice -n 10 go install -trimpath "$MODULE/cmd/training-operator.v1@$VERSION"
mv -f "$WORK/bin/training-operator.v1" "$BIN"
echo ">> built in $((SECONDS - started))s: $BIN" >&2

# The manifests of the same version (the module cache is read-only: copy them, writable).
rm -rf "$MANIFESTS.tmp"
mkdir -p "$MANIFESTS.tmp"
cp -r "$dir/manifests/base/crds" "$dir/manifests/base/rbac" "$dir/manifests/base/webhook" \
  "$MANIFESTS.tmp/"
chmod -R u+w "$MANIFESTS.tmp"
rm -rf "$MANIFESTS"
mv "$MANIFESTS.tmp" "$MANIFESTS"
echo "$MANIFESTS"
echo "$BIN"
