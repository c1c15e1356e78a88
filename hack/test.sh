#!/usr/bin/env bash
# `make test`: everything CI runs, in the order that fails fastest, each layer stopping the run:
#   1 lint    ruff, import contracts, drift checks, the docs site, helm lint, actionlint
#   2 unit    seconds, no cluster
#   3 build   the cluster and its images (hack/cluster-up.sh): built before any cluster test, so
#             no test's time limit pays for a cold build, and in the background from the start,
#             beside the steps above; then Kueue (hack/build-kueue.sh), which only the e2e layer
#             installs, in the background beside the integration layer
#   4 integration, 5 e2e   against that cluster
# Each layer writes a JUnit file; at the end (pass or fail) test-reports/durations.txt lists
# every test by duration, slowest first, so the suite's time can be compared run to run.
#   TEST_LAYERS="unit integration" make test   runs only those layers (lint and build as needed)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
REPORTS="${TEST_REPORTS:-$ROOT/test-reports}"
LAYERS="${TEST_LAYERS:-lint unit integration e2e}"
# End-to-end modules side by side (real trainings, CPU-bound): as many as the machine has cores.
E2E_WORKERS="${TEST_E2E_WORKERS:-$(nproc)}"
CACHE_DIR="${ACCELERATE_OPERATOR_CACHE:-$HOME/.cache/accelerate-operator}"
# What a cold build takes on disk (the control plane and Kueue builds, the images twice: buildah's
# storage and the nodes' containerd, the venv with torch), measured from empty caches.
COLD_DISK_GB=40
started=$(date +%s)
step=""

mkdir -p "$REPORTS"
rm -f "$REPORTS"/*.xml "$REPORTS/durations.txt"

finish() {
  local code=$1
  # The background builds still running (one that ended is gone: kill fails, and must not end
  # this trap under set -e before it reports).
  local pid
  for pid in $build $kueue_build; do kill -- "-$pid" 2>/dev/null || true; done
  VENV="$(hack/python-env.sh 2>/dev/null | tail -n1)" || VENV=""
  if [[ -n $VENV ]] && compgen -G "$REPORTS/*.xml" >/dev/null; then
    "$VENV/bin/python" hack/test_durations.py "$REPORTS" >"$REPORTS/durations.txt" || true
    echo "== make test: durations of every test in $REPORTS/durations.txt (JUnit: $REPORTS/*.xml)"
  fi
  local took=$(( $(date +%s) - started ))
  if [[ $code -ne 0 ]]; then
    echo "== make test: FAILED in step '$step' after $((took / 60))m$((took % 60))s" >&2
  else
    echo "== make test: passed in $((took / 60))m$((took % 60))s"
  fi
}

wants() { [[ " $LAYERS " == *" $1 "* ]]; }
begin() { step=$1; echo; echo "== make test: $1 ($(( $(date +%s) - started ))s)"; }

check_disk() {
  # Only a cold cache needs the room; say so before spending twenty minutes.
  [[ -d $CACHE_DIR/bin && -d $CACHE_DIR/venv ]] && return 0
  mkdir -p "$CACHE_DIR"
  local free_gb
  free_gb=$(df -Pk "$CACHE_DIR" | awk 'NR==2 {print int($4 / 1048576)}')
  echo "== make test: a cold build needs about ${COLD_DISK_GB} GB under $CACHE_DIR; ${free_gb} GB free"
  if (( free_gb < COLD_DISK_GB )); then
    echo "make test: not enough disk for a cold build (set ACCELERATE_OPERATOR_CACHE elsewhere)" >&2
    return 1
  fi
}

run_pytest() {
  local layer=$1 report=$2; shift 2
  local code=0
  "$VENV/bin/python" -m pytest "tests/$layer" -p no:cacheprovider --durations=15 \
    --junitxml="$REPORTS/$report.xml" -o junit_family=xunit2 "$@" ${PYTEST_ARGS:-} || code=$?
  [[ $code -eq 5 ]] && code=0  # none selected
  return "$code"
}

pytest_layer() {
  # The tests that share nothing run side by side (pytest-xdist, a module to a worker, so module
  # fixtures run once); the `exclusive` ones (tests/conftest.py) then run alone; last, those that
  # stop the deployed operator and run one of their own for their namespace (`operator_stopped`)
  # side by side again, under one stop. A layer that fails stops the run once all have run.
  local layer=$1 workers=$2 code=0
  run_pytest "$layer" "$layer" -m "not exclusive" -n "$workers" --dist loadscope || code=$?
  run_pytest "$layer" "$layer-exclusive" -m "exclusive and not operator_stopped" || code=$?
  if [[ $layer == integration ]]; then  # the only layer that has them
    run_pytest "$layer" "$layer-operator-stopped" -m operator_stopped -n "$workers" \
      --dist loadscope || code=$?
  fi
  return "$code"
}

build_cluster() {
  # The cluster and its images, in the background while the Python environment, lint and unit
  # tests run (on a cold machine the downloads and the compiles overlap); its output goes to
  # $REPORTS/build.log and its last line is the kubeconfig.
  # In a session of its own, so that a failed lint or unit test stops the whole build with it.
  setsid hack/cluster-up.sh >"$REPORTS/kubeconfig" 2>"$REPORTS/build.log" &
  build=$!
}

build_kueue() {
  # Kueue's image and manifests (a Go build, minutes cold, seconds warm): only tests/e2e/
  # test_kueue.py installs it, so it builds beside the integration layer, not before it.
  setsid hack/build-kueue.sh >/dev/null 2>"$REPORTS/build-kueue.log" &
  kueue_build=$!
}

await_build() {
  # A background build's end: on failure, the tail of its log and what failed, once.
  local pid=$1 log=$2 failed=$3
  if ! wait "$pid"; then
    tail -n 40 "$log" >&2
    echo "make test: $failed ($log)" >&2
    return 1
  fi
}

await_kueue() {
  begin "build: waiting for Kueue ($REPORTS/build-kueue.log)"
  await_build "$kueue_build" "$REPORTS/build-kueue.log" "the Kueue build failed"
  kueue_build=""
}

await_cluster() {
  begin "build: waiting for the cluster, its images and the operator ($REPORTS/build.log)"
  await_build "$build" "$REPORTS/build.log" "the build failed; the step is named above"
  build=""
  KUBECONFIG="$(tail -n1 "$REPORTS/kubeconfig")"
  export KUBECONFIG
  # The tests' session fixture finds the cluster up and does not build it again.
  export ACCELERATE_OPERATOR_CLUSTER_READY="$KUBECONFIG"
}

build=""
kueue_build=""
trap 'finish $?' EXIT
begin "disk"; check_disk
if wants integration || wants e2e; then begin "build: started in the background"; build_cluster; fi
begin "python environment"; VENV="$(hack/python-env.sh | tail -n1)"
if wants lint; then begin "lint"; make --no-print-directory lint; fi
if wants unit; then begin "unit"; run_pytest unit unit -n 2 --dist loadscope; fi
if wants integration || wants e2e; then await_cluster; fi
if wants e2e; then build_kueue; fi
if wants integration; then begin "integration"; pytest_layer integration 3; fi
if wants e2e; then await_kueue; fi
# Trainings are CPU-bound: more than two side by side on two cores only slow every one down.
if wants e2e; then begin "e2e"; pytest_layer e2e "$E2E_WORKERS"; fi
