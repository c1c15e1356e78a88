#!/usr/bin/env bash
# Generate the Helm chart's copy of the AccelerateJob CRD from crds/, the one hand-written source.
#
#   hack/sync-chart-crd.sh          write charts/accelerate-operator/templates/crds/<file>
#   hack/sync-chart-crd.sh --check  exit 1 with a diff when the chart's copy has drifted
#
# The copy is the source verbatim, with three templated additions only: the whole file is wrapped
# in `{{- if .Values.crds.enabled }}`, metadata gets the `helm.sh/resource-policy: keep`
# annotation when crds.keep is true, and any literal "{{" in the source is escaped so Helm renders
# it unchanged. Generation is deterministic, so the check regenerates the copy in memory and
# compares it with the file: any hand edit, stale copy or missing file is drift.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC_DIR="$ROOT/crds"
DST_DIR="$ROOT/charts/accelerate-operator/templates/crds"

mode="write"
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

# render SRC: print the chart template for one CRD file.
render() {
  local src="$1"
  if grep -qE '^  annotations:' "$src"; then
    # Keeping this generator simple: merging with existing metadata annotations is not supported.
    echo "sync-chart-crd: $src has metadata.annotations; teach hack/sync-chart-crd.sh to merge them" >&2
    exit 2
  fi
  if [[ "$(grep -c '^metadata:$' "$src")" != 1 ]]; then
    echo "sync-chart-crd: $src must contain exactly one top-level 'metadata:' line" >&2
    exit 2
  fi
  printf '%s\n' \
    "{{- /* GENERATED from crds/$(basename "$src") by hack/sync-chart-crd.sh: do not edit." \
    "Edit the file in crds/, then run hack/sync-chart-crd.sh (make manifests). */ -}}" \
    "{{- if .Values.crds.enabled }}"
  awk '
    { gsub(/\{\{/, "{{ \"{{\" }}") }
    { print }
    /^metadata:$/ {
      print "  {{- if .Values.crds.keep }}"
      print "  annotations:"
      print "    # Uninstalling the chart must not delete the CRD and with it every AccelerateJob."
      print "    helm.sh/resource-policy: keep"
      print "  {{- end }}"
    }
  ' "$src"
  echo "{{- end }}"
}

shopt -s nullglob
srcs=("$SRC_DIR"/*.yaml)
[[ ${#srcs[@]} -gt 0 ]] || { echo "sync-chart-crd: no CRD in $SRC_DIR" >&2; exit 2; }

drift=0
expected=()
for src in "${srcs[@]}"; do
  dst="$DST_DIR/$(basename "$src")"
  expected+=("$dst")
  if [[ $mode == write ]]; then
    mkdir -p "$DST_DIR"
    render "$src" > "$dst.tmp"
    mv -f "$dst.tmp" "$dst"
    echo "wrote ${dst#"$ROOT"/}" >&2
  elif ! diff -u --label "${dst#"$ROOT"/} (in the chart)" --label "generated from ${src#"$ROOT"/}" \
         "$dst" <(render "$src") >&2; then
    [[ -f $dst ]] || echo "sync-chart-crd: ${dst#"$ROOT"/} is missing" >&2
    drift=1
  fi
done

# A CRD removed from crds/ must not linger in the chart.
for dst in "$DST_DIR"/*.yaml; do
  [[ " ${expected[*]} " == *" $dst "* ]] && continue
  if [[ $mode == write ]]; then
    rm -f "$dst"; echo "removed ${dst#"$ROOT"/} (no longer in crds/)" >&2
  else
    echo "sync-chart-crd: ${dst#"$ROOT"/} has no source in crds/" >&2; drift=1
  fi
done

if [[ $drift == 1 ]]; then
  echo "sync-chart-crd: the chart's CRD copy has drifted from crds/ (diff above)." >&2
  echo "Run hack/sync-chart-crd.sh (make manifests) and commit the result; never edit the chart's copy." >&2
  exit 1
fi
[[ $mode == check ]] && echo "sync-chart-crd: chart CRDs match crds/" >&2
exit 0
