#!/usr/bin/env bash
# `make bench`: bring the local cluster up with hack/cluster-up.sh (idempotent, seconds when warm:
# control plane, the two nodes, the operator and trainer images built from this checkout and loaded
# into the nodes, the operator deployed with its Helm chart), run every benchmark, then print a
# summary against the targets (docs/performance.md).
#
#   bench/run.sh                     everything at full size, the scale curve to 5,000 jobs included
#                                    (about 45 minutes on 2 loaded cores)
#   bench/run.sh --quick             smaller runs for development (about 5 minutes)
#   bench/run.sh startup throughput  only these (startup, throughput, overhead)
#   bench/run.sh throughput kubeflow our operator, then Kubeflow's Go training-operator (built
#                                    once by hack/build-training-operator.sh, run as a host
#                                    process) on the same burst; not in the default set
#   bench/run.sh running             what reporting progress adds to the control plane's CPU
#                                    per second per running job (100 single-node jobs printing
#                                    like a trainer, bare and then under the supervisor; about 9
#                                    minutes); not in the default set: its 100 pods fill most of
#                                    the nodes' pod capacity
#   bench/run.sh recovery            what a crash, a pod deletion and a lost node cost a training
#                                    job, ours and Kubeflow's PyTorchJob (the Go training-operator
#                                    as for `kubeflow`) side by side; about 20 minutes; not in the
#                                    default set: it powers one node off and back on
#   bench/run.sh status-write        the API server's CPU per progress write, and the shares of
#                                    it of the CRD's CEL rules, the atomic status and the status's
#                                    size (its own etcd and kube-apiserver; about two minutes);
#                                    not in the default set
#
# Extra arguments per benchmark: BENCH_STARTUP_ARGS, BENCH_THROUGHPUT_ARGS, BENCH_OVERHEAD_ARGS,
# BENCH_KUBEFLOW_ARGS, BENCH_RUNNING_ARGS, BENCH_RECOVERY_ARGS, BENCH_STATUS_WRITE_ARGS (for example BENCH_THROUGHPUT_ARGS="--jobs 100 --mode
# both", BENCH_RUNNING_ARGS="--mode bare"). Raw results, one JSON line per benchmark, go to
# $BENCH_JSON (default: a file under /tmp, named at the end).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

quick=0
selected=()
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 ;;
    startup|throughput|overhead|kubeflow|running|recovery|status-write) selected+=("$arg") ;;
    *) echo "usage: $0 [--quick] [startup] [throughput] [overhead] [kubeflow] [running] [recovery] [status-write]" >&2
       exit 2 ;;
  esac
done
[[ ${#selected[@]} -gt 0 ]] || selected=(startup throughput overhead)

PY="$(hack/python-env.sh | tail -n1)/bin/python"
# This checkout's packages, whichever checkout last installed itself into the shared venv.
export PYTHONPATH="$ROOT/operator:$ROOT/trainer${PYTHONPATH:+:$PYTHONPATH}"

# The operator as shipped: the chart's progress write interval (the tests deploy a shorter one).
shipped_interval=$("$PY" -c 'import sys, yaml
print(yaml.safe_load(open(sys.argv[1]))["reports"]["progressWriteSeconds"])' \
  charts/accelerate-operator/values.yaml)
export ACCELERATE_OPERATOR_PROGRESS_WRITE_SECONDS="${ACCELERATE_OPERATOR_PROGRESS_WRITE_SECONDS:-$shipped_interval}"
# The cluster is shared: someone may be restarting it. Wait and retry rather than fail at once.
kubeconfig=""
for attempt in 1 2 3 4 5; do
  if kubeconfig=$(hack/cluster-up.sh | tail -n1); then break; fi
  kubeconfig=""
  echo ">> local cluster not up (attempt $attempt); retrying in 20s" >&2
  sleep 20
done
[[ -n $kubeconfig ]] || { echo "error: the local cluster did not come up" >&2; exit 1; }
export KUBECONFIG=$kubeconfig

export BENCH_JSON="${BENCH_JSON:-$(mktemp /tmp/accelerate-operator-bench.XXXXXX.jsonl)}"
if [[ $quick == 1 ]]; then
  startup_args="--runs 2"; throughput_args="--jobs 100 --single 10"; overhead_args="--pairs 1 --max-steps 100"
  kubeflow_args="--jobs 100"; running_args="--jobs 20 --window 20"; recovery_args="--faults crash,delete"
else
  startup_args="--runs 5"; throughput_args="--jobs 500 --single 10 --bursts 5 --curve 100,2000,5000"; overhead_args="--pairs 3"
  kubeflow_args="--jobs 500"; running_args="--jobs 100"; recovery_args=""
fi

started=$SECONDS
for bench in "${selected[@]}"; do
  case "$bench" in
    startup) "$PY" bench/startup.py $startup_args ${BENCH_STARTUP_ARGS:-} ;;
    throughput) "$PY" bench/throughput.py $throughput_args ${BENCH_THROUGHPUT_ARGS:-} ;;
    overhead) "$PY" bench/overhead.py $overhead_args ${BENCH_OVERHEAD_ARGS:-} ;;
    kubeflow) "$PY" bench/kubeflow_compare.py $kubeflow_args ${BENCH_KUBEFLOW_ARGS:-} ;;
    running) "$PY" bench/running.py $running_args ${BENCH_RUNNING_ARGS:-} ;;
    recovery) "$PY" bench/recovery.py $recovery_args ${BENCH_RECOVERY_ARGS:-} ;;
    status-write) "$PY" bench/status_write.py ${BENCH_STATUS_WRITE_ARGS:-} ;;
  esac
  echo
done
"$PY" bench/summary.py "$BENCH_JSON"
echo "(benchmarks took $((SECONDS - started))s; raw results: $BENCH_JSON)"
