#!/usr/bin/env bash
# Create (once) and refresh the project's Python virtual environment, then print its path.
#
# The venv lives outside the repository ($ACCELERATE_OPERATOR_CACHE/venv) so a fresh clone,
# CI included, reuses the multi-gigabyte torch install. The project itself is re-installed
# from the calling checkout whenever its code differs (seconds), so the venv always runs the
# code of the clone that called it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_DIR="${ACCELERATE_OPERATOR_CACHE:-$HOME/.cache/accelerate-operator}"
VENV="${ACCELERATE_OPERATOR_VENV:-$CACHE_DIR/venv}"
PYTHON="${PYTHON:-python3}"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo ">> creating the Python environment in $VENV (first run downloads torch: several minutes)" >&2
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >&2
fi

# Re-install dependencies only when pyproject.toml changed since the last install.
stamp="$VENV/.pyproject.sha256"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [[ "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  echo ">> installing Python dependencies into $VENV" >&2
  "$VENV/bin/pip" install -q "setuptools>=68" wheel >&2
  "$VENV/bin/pip" install -q "${ROOT}[dev]" >&2
  # DeepSpeed's setup.py imports torch, so it builds against the torch already here (no
  # isolated build env, which would download torch again); DS_BUILD_OPS=0 compiles no CUDA ops:
  # tests construct its plugin on CPU, kernels are built on GPU machines at first use.
  DS_BUILD_OPS=0 "$VENV/bin/pip" install -q --no-build-isolation "deepspeed>=0.14" >&2
  echo "$want" > "$stamp"
  rm -f "$VENV/.code.sha256"
fi

# The project itself is installed as a copy, not editable, re-installed whenever its code
# changes. Pods on the local node run this venv in place of an image, and a pod may mount
# its own /tmp (the operator's chart does): a copy works wherever the checkout lives.
code_stamp="$VENV/.code.sha256"
code=$(cd "$ROOT" && find operator trainer pyproject.toml -name '*.py' -o -name pyproject.toml \
  | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
if [[ "$(cat "$code_stamp" 2>/dev/null)" != "$code" ]]; then
  "$VENV/bin/pip" install -q --no-deps --no-build-isolation --force-reinstall "$ROOT" >&2
  rm -rf "$ROOT/build" "$ROOT"/operator/*.egg-info "$ROOT"/trainer/*.egg-info
  echo "$code" > "$code_stamp"
fi
echo "$VENV"
