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
ensure_buildah

if bah inspect --type image "$LOCAL_BASE_IMAGE" >/dev/null 2>&1; then
  echo "$LOCAL_BASE_IMAGE"
  exit 0
fi
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
if ! command -v mmdebstrap >/dev/null || [[ ! -s $KEYRING ]]; then
  echo ">> installing mmdebstrap and Debian's archive keyring" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap debian-archive-keyring >&2
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/base-image.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# On a Debian host, its own apt sources (deb822 or one-line), so a mirror configured here is used
# there too; elsewhere (Ubuntu: GitHub's runners) Debian's archive, checked with Debian's keyring,
# so the base is the same bookworm on every machine.
sources=()
if grep -qx 'ID=debian' /etc/os-release 2>/dev/null; then
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [[ -s $f ]] && grep -qE '^(deb |Types:)' "$f" && sources+=("$f")
  done
fi
[[ ${#sources[@]} -gt 0 ]] || sources=("deb [signed-by=$KEYRING] http://deb.debian.org/debian bookworm main")

echo ">> mmdebstrap: Debian bookworm with python3 (about a minute)" >&2
mmdebstrap --variant=minbase --quiet --keyring="$KEYRING" \
  --include=python3,python3-venv,python-is-python3,ca-certificates,passwd \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
  bookworm "$work/rootfs.tar" "${sources[@]}" >&2

ctr=$(bah from scratch)
bah add "$ctr" "$work/rootfs.tar" / >&2
bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env LANG=C.UTF-8 --cmd python3 \
  --label org.opencontainers.image.description="Debian bookworm with python3, built by mmdebstrap" "$ctr"
bah commit --rm "$ctr" "$LOCAL_BASE_IMAGE" >&2
echo "$LOCAL_BASE_IMAGE"
