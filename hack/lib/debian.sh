# shellcheck shell=bash
# Sourced by the scripts that make a Debian root filesystem with mmdebstrap (the local base image,
# the kind node image and its images).

# debian_sources: the host's own apt sources (deb822 or one-line), one per line, so a mirror
# configured here is used there too; Debian's own archive when the host has none.
debian_sources() {
  local f found=0
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    if [[ -s $f ]] && grep -qE '^(deb |Types:)' "$f"; then echo "$f"; found=1; fi
  done
  [[ $found == 1 ]] || echo http://deb.debian.org/debian
}

ensure_mmdebstrap() {
  command -v mmdebstrap >/dev/null && return
  echo ">> installing mmdebstrap" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 mmdebstrap >&2
}

# debian_rootfs TAR PACKAGE...: Debian bookworm's minbase with PACKAGE... (no recommends, no
# manuals, locales or docs but the copyrights, no apt lists) as a tarball; kept when TAR exists.
debian_rootfs() {
  local tar=$1 sources; shift
  [[ -s $tar ]] && return
  ensure_mmdebstrap
  mapfile -t sources < <(debian_sources)
  echo ">> mmdebstrap: Debian bookworm with $* (a minute or two)" >&2
  mkdir -p "$(dirname "$tar")"
  # shellcheck disable=SC2016  # $1 is mmdebstrap's, in its hook
  mmdebstrap --variant=minbase --quiet --format=tar --include="$(IFS=,; echo "$*")" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$tar.tmp" "${sources[@]}" >&2
  mv "$tar.tmp" "$tar"
}
