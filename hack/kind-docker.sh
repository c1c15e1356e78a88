#!/usr/bin/env bash
# A Docker engine for kind on machines whose own engine cannot start kind's nodes.
#
#   hack/kind-docker.sh up      build (once) and start it; last stdout line: its DOCKER_HOST
#   hack/kind-docker.sh down    stop it (its images and containers stay in the cache)
#   hack/kind-docker.sh status
#
# Why: kind starts every node with `docker run --privileged`. Where this process's capability
# bounding set lacks a capability (our machines lack CAP_SYS_RESOURCE: CapBnd 000001fffeffffff),
# Debian's docker.io 20.10 and podman 4.3 ask runc for every capability the kernel knows and fail
# with "unable to apply caps: operation not permitted". Moby since v25 gives a privileged
# container the capabilities this process has (oci/caps: containerd's cap.Current()), so its
# dockerd runs kind as released. It is built here from the Go module proxy (moby keeps no go.mod
# before v29: its vendor.mod is the module file) and run beside, never instead of, anything else:
# its own socket, data root and exec root, so `docker info` on the default socket still answers
# as before and no build script picks it up by accident. containerd and runc are Debian's.
#
# Environment: ACCELERATE_OPERATOR_CACHE (default ~/.cache/accelerate-operator); DOCKERD_VERSION.
set -euo pipefail
CACHE_DIR="${ACCELERATE_OPERATOR_CACHE:-$HOME/.cache/accelerate-operator}"
DOCKERD_VERSION="${DOCKERD_VERSION:-v28.5.2}"
K="$CACHE_DIR/kind"
BIN="$K/bin/docker-$DOCKERD_VERSION"
RUN=/run/accelerate-operator/kind-docker
SOCKET="$RUN/docker.sock"
DOCKER_HOST_URL="unix://$SOCKET"

log() { echo ">> kind-docker: $*" >&2; }
die() { echo "kind-docker: ERROR: $*" >&2; exit 1; }

ensure_packages() {  # the runtime dockerd drives, and the firewall tools it calls
  local missing=() p
  for p in containerd:containerd runc:runc iptables:iptables; do
    command -v "${p%%:*}" >/dev/null || missing+=("${p#*:}")
  done
  [[ ${#missing[@]} == 0 ]] && return
  log "installing ${missing[*]} (Debian)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=600 "${missing[@]}" >&2
}

build() {  # dockerd and docker-proxy from github.com/docker/docker@$DOCKERD_VERSION
  [[ -x $BIN/dockerd && -x $BIN/docker-proxy ]] && return
  command -v go >/dev/null || die "Go is needed to build dockerd (apt-get install golang, or https://go.dev/dl)"
  local module="github.com/docker/docker@$DOCKERD_VERSION+incompatible" src dir
  log "building dockerd $DOCKERD_VERSION from the Go module proxy (about 10 minutes cold on 2 cores)"
  dir=$(go mod download -json "$module" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  src="$K/build/docker-$DOCKERD_VERSION"
  rm -rf "$src" && mkdir -p "$src" "$BIN"
  cp -r "$dir/." "$src" && chmod -R u+w "$src"
  # The module zip keeps vendor.mod and vendor.sum but not vendor/: build in module mode from them.
  (cd "$src" && cp vendor.mod go.mod && cp vendor.sum go.sum && rm -rf vendor &&
    for cmd in dockerd docker-proxy; do
      CGO_ENABLED=0 GOFLAGS=-mod=mod go build -trimpath -tags "exclude_graphdriver_btrfs netgo osusergo" \
        -ldflags "-s -w -X github.com/docker/docker/dockerversion.Version=${DOCKERD_VERSION#v}" \
        -o "$BIN/$cmd.tmp" "./cmd/$cmd" >&2 && mv "$BIN/$cmd.tmp" "$BIN/$cmd"
    done)
  rm -rf "$src"
}

running() { [[ -S $SOCKET ]] && DOCKER_HOST=$DOCKER_HOST_URL docker version >/dev/null 2>&1; }

cmd_up() {
  command -v docker >/dev/null || die "the docker CLI is needed on PATH (kind calls it)"
  if running; then echo "$DOCKER_HOST_URL"; return; fi
  [[ $EUID -eq 0 ]] || die "dockerd needs root"
  ensure_packages
  build
  mkdir -p "$RUN" "$K/docker"
  cat >"$RUN/daemon.json" <<EOF
{
  "data-root": "$K/docker",
  "exec-root": "$RUN/exec",
  "pidfile": "$RUN/dockerd.pid",
  "hosts": ["$DOCKER_HOST_URL"],
  "storage-driver": "overlay2",
  "exec-opts": ["native.cgroupdriver=cgroupfs"],
  "userland-proxy-path": "$BIN/docker-proxy",
  "ip-forward-no-drop": true,
  "log-level": "warn"
}
EOF
  log "starting dockerd $DOCKERD_VERSION (log: $K/dockerd.log)"
  # setsid and no inherited descriptors: the daemon outlives this script and holds no lock of it.
  PATH="$BIN:$PATH" setsid dockerd --config-file "$RUN/daemon.json" >>"$K/dockerd.log" 2>&1 </dev/null 9>&- &
  local i
  for ((i = 0; i < 120; i++)); do
    running && { echo "$DOCKER_HOST_URL"; return; }
    sleep 0.5
  done
  tail -n 20 "$K/dockerd.log" >&2
  die "dockerd did not answer on $SOCKET within 60s (log above)"
}

cmd_down() {
  local pid i
  pid=$(cat "$RUN/dockerd.pid" 2>/dev/null) || return 0
  kill -TERM "$pid" 2>/dev/null || return 0
  for ((i = 0; i < 300; i++)); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  die "dockerd ($pid) still runs 30s after SIGTERM"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) if running; then echo "running: DOCKER_HOST=$DOCKER_HOST_URL"; else echo "stopped"; fi ;;
  *) echo "usage: $0 up | down | status" >&2; exit 2 ;;
esac
