#!/usr/bin/env bash
# The local cluster with the operator running (`make cluster-up`). Idempotent; a warm run takes
# seconds. The last stdout line is the kubeconfig's path; progress goes to stderr.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Pods on the local node run this venv: bring it up to date with this checkout first.
"$ROOT/hack/python-env.sh" >/dev/null
BIN=$("$ROOT/hack/build-control-plane.sh" | tail -n1)
export PATH="$BIN:$PATH"
kubeconfig=$("$ROOT/hack/local-cluster.sh" up | tail -n1)

# The local node runs the host's environment in place of the trainer image, so the host gets the
# image's layout: the example script where the image has it (images/trainer/Dockerfile).
mkdir -p /opt/accelerate/examples
ln -sfn "$ROOT/examples/train.py" /opt/accelerate/examples/train.py

KUBECONFIG="$kubeconfig" "$ROOT/hack/deploy-operator.sh" >&2
echo "$kubeconfig"
