#!/usr/bin/env bash
# `make demo`: the main job. Starts the local cluster and the operator (building what is missing
# on a fresh machine), submits the CPU example (2 nodes x 2 processes of DDP over gloo), shows
# its progress, and ends with the job Succeeded and where to look next.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NAMESPACE="${DEMO_NAMESPACE:-demo}"
JOB=cpu-ddp
started=$(date +%s)

echo "== 1/3 local cluster and operator (the first run builds Kubernetes, the nodes and the images: ~35 min)"
kubeconfig=$("$ROOT/hack/cluster-up.sh" | tail -n1)
export KUBECONFIG="$kubeconfig"
PATH_DIR="$("$ROOT/hack/install-cli.sh" | tail -n1)"
export PATH="$PATH_DIR:$PATH"
echo "   cluster ready in $(( $(date +%s) - started ))s; KUBECONFIG=$KUBECONFIG"

echo "== 2/3 kubectl apply -f examples/cpu-ddp.yaml (namespace $NAMESPACE)"
kubectl create namespace "$NAMESPACE" --dry-run=client -o yaml | kubectl apply -f - >/dev/null
kubectl -n "$NAMESPACE" delete acceleratejob "$JOB" --ignore-not-found --cascade=foreground --wait=true >/dev/null
kubectl -n "$NAMESPACE" apply -f "$ROOT/examples/cpu-ddp.yaml"

echo "== 3/3 training (kubectl -n $NAMESPACE get ajob $JOB)"
submitted=$(date +%s)
last=""
phase=""
while (( $(date +%s) - submitted < 900 )); do
  row=$(kubectl -n "$NAMESPACE" get ajob "$JOB" --no-headers 2>/dev/null || true)
  phase=$(kubectl -n "$NAMESPACE" get ajob "$JOB" -o jsonpath='{.status.phase}' 2>/dev/null || true)
  if [[ "$row" != "$last" ]]; then
    printf '   %4ss  %s\n' "$(( $(date +%s) - submitted ))" "$row"
    last=$row
  fi
  [[ "$phase" == Succeeded || "$phase" == Failed ]] && break
  sleep 2
done

echo
kubectl -n "$NAMESPACE" get ajob "$JOB"
if [[ "$phase" != Succeeded ]]; then
  echo "The job did not succeed. Look at: kubectl -n $NAMESPACE describe ajob $JOB" >&2
  kubectl -n "$NAMESPACE" describe ajob "$JOB" | tail -20 >&2
  exit 1
fi
echo
echo "Ranks that trained (from the pods' logs):"
for pod in "$JOB-0" "$JOB-1"; do
  kubectl -n "$NAMESPACE" logs "$pod" | grep -E '^(RANK_INFO|FINAL)' | sed "s/^/   [$pod] /"
done
kubectl -n "$NAMESPACE" logs "$JOB-0" | grep -E '^TRAINING_DONE' | sed 's/^/   /'
cat <<NEXT

Succeeded in $(( $(date +%s) - submitted ))s after submission ($(( $(date +%s) - started ))s in all).
Next, in any shell (kubectl, helm and accelerate-job are in $PATH_DIR):
  export PATH="$PATH_DIR:\$PATH" KUBECONFIG="$KUBECONFIG"
  kubectl -n $NAMESPACE describe ajob $JOB         # conditions and events: the job's story
  kubectl -n $NAMESPACE logs $JOB-0                # rank 0 and 1; $JOB-1 has ranks 2 and 3
  kubectl -n $NAMESPACE get configmap $JOB-accelerate-config -o yaml   # the rendered accelerate config
  accelerate-job -n $NAMESPACE logs $JOB --all --tail 5   # every node's log, through restarts
  helm -n accelerate-system status accelerate-operator    # the operator's release
  make -C $ROOT cluster-down                       # stop the local cluster
NEXT
