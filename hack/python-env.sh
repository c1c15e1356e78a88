#!/usr/bin/env bash
# Create (once) and refresh the project's Python virtual environment, then print its path.
#
# The venv lives outside the repository ($ACCELERATE_OPERATOR_CACHE/venv) so a fresh clone,
# CI included, reuses the multi-gigabyte torch install. The project itself is installed
# editable from the current checkout on every call (seconds), so the venv always runs the
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
  "$VENV/bin/pip" install -q -e "${ROOT}[dev]" >&2
  # DeepSpeed's setup.py imports torch, so it builds against the torch already here (no
  # isolated build env, which would download torch again); DS_BUILD_OPS=0 compiles no CUDA ops:
  # tests construct its plugin on CPU, kernels are built on GPU machines at first use.
  DS_BUILD_OPS=0 "$VENV/bin/pip" install -q --no-build-isolation "deepspeed>=0.14" >&2
  echo "$want" > "$stamp"
elif ! "$VENV/bin/python" - "$ROOT" >/dev/null 2>&1 <<'PY'
import importlib.util, pathlib, sys
specs = [importlib.util.find_spec(name) for name in ("accelerate_operator", "accelerate_trainer")]
sys.exit(0 if all(s and pathlib.Path(s.origin).is_relative_to(sys.argv[1]) for s in specs) else 1)
PY
then
  # Same dependencies, different checkout (a fresh CI clone): point the editable install here.
  "$VENV/bin/pip" install -q --no-deps -e "$ROOT" >&2
fi
echo "$VENV"
