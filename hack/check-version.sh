#!/usr/bin/env bash
# The release version has one source, `version` in pyproject.toml: the image tags
# (hack/build-images.sh, devtools/images.py, the release workflow) are read from it. The chart
# must say the same in Chart.yaml (`version` and `appVersion`, whose value tags the operator image
# when image.tag is empty), and a release tag must be `v<version>`.
#
#   hack/check-version.sh               check pyproject.toml against the chart
#   hack/check-version.sh --tag v0.2.0  also check a release tag
#
# Prints the version as the last line of stdout; exits 1, saying what to change, on a mismatch.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CHART="$ROOT/charts/accelerate-operator/Chart.yaml"

tag=""
case "${1:-}" in
  "") ;;
  --tag) tag="${2:?usage: $0 [--tag vX.Y.Z]}" ;;
  *) echo "usage: $0 [--tag vX.Y.Z]" >&2; exit 2 ;;
esac

version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$ROOT/pyproject.toml" | head -n1)"
[[ -n "$version" ]] || { echo "check-version: no version = \"...\" in pyproject.toml" >&2; exit 1; }
chart_version="$(sed -n 's/^version: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$CHART" | head -n1)"
app_version="$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$CHART" | head -n1)"

fail=0
if [[ "$chart_version" != "$version" ]]; then
  echo "check-version: Chart.yaml version is '$chart_version' but pyproject.toml says '$version'; set both to the release version" >&2
  fail=1
fi
if [[ "$app_version" != "$version" ]]; then
  echo "check-version: Chart.yaml appVersion is '$app_version' but pyproject.toml says '$version': the chart would deploy another operator image than the release builds; set it to \"$version\"" >&2
  fail=1
fi
if [[ -n "$tag" && "$tag" != "v$version" ]]; then
  echo "check-version: the tag '$tag' does not name the version in pyproject.toml ('$version'); tag v$version, or bump pyproject.toml and Chart.yaml first" >&2
  fail=1
fi
[[ $fail == 0 ]] || exit 1
echo "check-version: pyproject.toml, Chart.yaml${tag:+ and tag $tag} agree on $version" >&2
echo "$version"
