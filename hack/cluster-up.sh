#!/usr/bin/env bash
# The local cluster with the operator running (`make cluster-up`). Idempotent; a warm run takes
# seconds. The last stdout line is the kubeconfig's path; progress goes to stderr.
#
# On a fresh machine this builds everything first: the control plane, kubelet and kube-proxy
# (hack/build-control-plane.sh), the Debian base, pause and CoreDNS images, and the project's
# operator and trainer-cpu images (hack/build-images.sh), all cached outside the repository.
# Last, kubectl, helm and accelerate-job go into one folder for a shell's PATH
# (hack/install-cli.sh); the line to run is printed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CLUSTER_IMAGES="${CLUSTER_IMAGES:-operator trainer-cpu}"

step=""
run_step() { step=$1; echo ">> cluster-up: $1" >&2; }
trap 'echo "cluster-up: FAILED at step: $step (its output is above)" >&2' ERR

# The control-plane compile (CPU) runs beside the image build (mostly downloads and disk): cold,
# they took 8.7 and 10.9 minutes one after the other. It does no apt-get, so the two never meet
# on apt's lock. In a process group of its own, so that a failed image build (or a killed
# cluster-up) stops the whole compile with it.
run_step "control plane binaries (hack/build-control-plane.sh), in the background"
bin_out=$(mktemp)
setsid "$ROOT/hack/build-control-plane.sh" >"$bin_out" &
compile=$!
trap 'kill -- "-$compile" 2>/dev/null || true; rm -f "$bin_out"' EXIT
run_step "images: $CLUSTER_IMAGES (hack/build-images.sh)"
# shellcheck disable=SC2086  # IMAGES is a list of words
images=$(IMAGES="$CLUSTER_IMAGES" "$ROOT/hack/build-images.sh")
run_step "control plane binaries (hack/build-control-plane.sh): waiting for the compile"
wait "$compile"
BIN=$(tail -n1 "$bin_out")
export PATH="$BIN:$PATH"
run_step "cluster (hack/local-cluster.sh up)"
kubeconfig=$("$ROOT/hack/local-cluster.sh" up | tail -n1)
run_step "load images into the nodes (hack/load-images.sh)"
# shellcheck disable=SC2086
"$ROOT/hack/load-images.sh" $images
run_step "operator (hack/deploy-operator.sh)"
KUBECONFIG="$kubeconfig" "$ROOT/hack/deploy-operator.sh" >&2
path_dir=$("$ROOT/hack/install-cli.sh" | tail -n1)
echo ">> cluster-up: kubectl, helm and accelerate-job for any shell:" >&2
echo "   export PATH=\"$path_dir:\$PATH\" KUBECONFIG=\"$kubeconfig\"" >&2
echo "$kubeconfig"
