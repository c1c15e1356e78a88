# shellcheck shell=bash
# Sourced by the scripts that make a Debian root filesystem with mmdebstrap (the local base image,
# the kind node image and its images).

KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

# debian_sources: on a Debian host its own apt sources (deb822 or one-line), one per line, so a
# mirror configured here is used there too; elsewhere (Ubuntu: GitHub's runners) Debian's archive,
# checked with Debian's keyring, so the root filesystem is the same bookworm on every machine.
debian_sources() {
  local f found=0
  grep -qx 'ID=debian' /etc/os-release 2>/dev/null || found=2
  [[ $found == 2 ]] || for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    if [[ -s $f ]] && grep -qE '^(deb |Types:)' "$f"; then echo "$f"; found=1; fi
  done
  [[ $found == 1 ]] || echo "deb [signed-by=$KEYRING] http://deb.debian.org/debian bookworm main"
}

ensure_mmdebstrap() {
  command -v mmdebstrap >/dev/null && [[ -s $KEYRING ]] && return
  echo ">> installing mmdebstrap and Debian's archive keyring" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 mmdebstrap \
    debian-archive-keyring >&2
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
  mmdebstrap --variant=minbase --quiet --format=tar --keyring="$KEYRING" --include="$(IFS=,; echo "$*")" \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
    bookworm "$tar.tmp" "${sources[@]}" >&2
  mv "$tar.tmp" "$tar"
}
