#!/usr/bin/env bash
# Build the local base image `localhost/accelerate-operator/debian-python:bookworm` from Debian's
# packages (mmdebstrap), for machines that can reach Debian's archive but no container registry.
# It stands in for python:3.11-slim: Debian bookworm, python3 (3.11) with venv, ca-certificates,
# passwd (useradd). Cached in buildah's storage: a second run returns at once.
#
# Prints the image name as the last line of stdout; progress goes to stderr.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=hack/lib/buildah.sh
source "$ROOT/hack/lib/buildah.sh"
# shellcheck source=hack/lib/debian.sh
source "$ROOT/hack/lib/debian.sh"
ensure_buildah

if bah inspect --type image "$LOCAL_BASE_IMAGE" >/dev/null 2>&1; then
  echo "$LOCAL_BASE_IMAGE"
  exit 0
fi
work="$(mktemp -d "${TMPDIR:-/tmp}/base-image.XXXXXX")"
trap 'rm -rf "$work"' EXIT
debian_rootfs "$work/rootfs.tar" python3 python3-venv python-is-python3 ca-certificates passwd

ctr=$(bah from scratch)
bah add "$ctr" "$work/rootfs.tar" / >&2
bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env LANG=C.UTF-8 --cmd python3 \
  --label org.opencontainers.image.description="Debian bookworm with python3, built by mmdebstrap" "$ctr"
bah commit --rm "$ctr" "$LOCAL_BASE_IMAGE" >&2
echo "$LOCAL_BASE_IMAGE"
