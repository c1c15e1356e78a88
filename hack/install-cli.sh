#!/usr/bin/env bash
# The commands the docs show, in one folder a shell can put on its PATH: kubectl (the cluster's
# own, hack/build-control-plane.sh), helm (hack/install-tools.sh) and accelerate-job with
# kubectl-accelerate (this checkout's CLI, in a small virtual environment of its own: the `client`
# extra, no torch). Prints the folder as the last line of stdout; progress goes to stderr.
#
#   export PATH="$HOME/.cache/accelerate-operator/path:$PATH"   # what `make cluster-up` prints
#
# Idempotent: the CLI is installed again only when this checkout's code changed (seconds).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_DIR="${ACCELERATE_OPERATOR_CACHE:-$HOME/.cache/accelerate-operator}"
VENV="$CACHE_DIR/cli-venv"
PATH_DIR="$CACHE_DIR/path"

if [[ ! -x $VENV/bin/python ]]; then
  echo ">> install-cli: a virtual environment for accelerate-job in $VENV" >&2
  "${PYTHON:-python3}" -m venv "$VENV"
fi
stamp="$VENV/.code.sha256"
code=$(cd "$ROOT" && find operator pyproject.toml -name '*.py' -o -name pyproject.toml \
  | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
if [[ "$(cat "$stamp" 2>/dev/null)" != "$code" ]]; then
  echo ">> install-cli: accelerate-job from $ROOT" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check "$ROOT[client]" >&2
  rm -rf "$ROOT/build" "$ROOT"/operator/*.egg-info "$ROOT"/trainer/*.egg-info
  echo "$code" >"$stamp"
fi

mkdir -p "$PATH_DIR"
ln -sfn "$("$ROOT/hack/build-control-plane.sh" | tail -n1)/kubectl" "$PATH_DIR/kubectl"
ln -sfn "$(INSTALL_TOOLS=helm "$ROOT/hack/install-tools.sh" | tail -n1)/helm" "$PATH_DIR/helm"
ln -sfn "$VENV/bin/accelerate-job" "$PATH_DIR/accelerate-job"
ln -sfn "$VENV/bin/kubectl-accelerate" "$PATH_DIR/kubectl-accelerate"
echo "$PATH_DIR"
