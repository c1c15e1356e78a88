#!/usr/bin/env bash
# Build a kind node image from what this project builds, for machines that cannot pull
# kindest/node (no container registry): `kind create cluster --image` takes it as it takes a
# released one.
#
#   DOCKER_HOST=unix://... hack/build-kind-node.sh     last stdout line: the image name
#
# The image holds what kind v$KIND_VERSION's own base and node images hold
# (sigs.k8s.io/kind images/base/Dockerfile and pkg/build/nodeimage), made from other sources:
# - the root filesystem: Debian bookworm by mmdebstrap with kindest/base's packages, containerd
#   and runc from Debian instead of upstream builds, the CNI plugins from Debian
#   (containernetworking-plugins), and kind's own files (entrypoint, systemd units, containerd
#   config) taken from the kind module of the pinned version;
# - kubeadm, kubelet and kubectl from hack/build-control-plane.sh, crictl from the Go module proxy;
# - the images kubeadm runs, named as kubeadm names them and imported into the image's containerd
#   as kind imports them: kube-apiserver, kube-controller-manager, kube-scheduler and kube-proxy
#   from the same binaries, etcd and CoreDNS built from the Go module proxy at the versions
#   kubeadm runs, the pause sandbox from hack/build-cluster-images.sh;
# - kind's default CNI and storage manifests: hack/kind/podnet.sh stands in for kindnetd (not
#   served by any registry we reach), and kind's own local-path-provisioner manifest runs
#   rancher/local-path-provisioner built from the Go module proxy.
# Needs root, buildah, Go, gcc (pause) and Debian's archive. A second run with the same inputs
# (binaries, base images, this script, hack/kind/, versions) returns in seconds.
set -euo pipefail
shopt -s inherit_errexit  # a failed step inside $(...) (the inputs' hash) stops the build
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=hack/lib/buildah.sh
source "$ROOT/hack/lib/buildah.sh"
# shellcheck source=hack/lib/debian.sh
source "$ROOT/hack/lib/debian.sh"

K8S_VERSION="${K8S_VERSION:-v1.34.4}"
KIND_VERSION=$(sed -n 's/^KIND_VERSION="\(.*\)"$/\1/p' "$ROOT/hack/install-tools.sh")
CRICTL_VERSION=v1.34.0          # cri-tools' release for Kubernetes 1.34
LOCAL_PATH_VERSION=v0.0.30      # kind's images/local-path-provisioner/Makefile at $KIND_VERSION
NODE_IMAGE="localhost/accelerate-operator/kind-node:$K8S_VERSION"
IPTABLES_BASE="localhost/accelerate-operator/debian-iptables:bookworm"
LOCAL="localhost/accelerate-operator/kind"
PODNET_IMAGE="$LOCAL/podnet:$K8S_VERSION"
PROVISIONER_IMAGE="$LOCAL/local-path-provisioner:$LOCAL_PATH_VERSION"
HELPER_IMAGE="$LOCAL/local-path-helper:$LOCAL_PATH_VERSION"
K="$CACHE_DIR/kind"
# kindest/base's packages (less nfs-common, open-iscsi and fuse-overlayfs: network storage and
# rootless), with containerd, runc and the CNI plugins that kindest/base builds from source.
NODE_PACKAGES=(systemd conntrack iptables nftables iproute2 ethtool util-linux mount kmod libseccomp2
               pigz bash ca-certificates curl jq procps containerd runc containernetworking-plugins)

log() { echo ">> build-kind-node: $*" >&2; }
die() { echo "build-kind-node: ERROR: $*" >&2; exit 1; }
[[ -n ${DOCKER_HOST:-} ]] || die "set DOCKER_HOST to the engine kind uses (hack/kind-docker.sh up prints it)"
[[ -n $KIND_VERSION ]] || die "no KIND_VERSION in hack/install-tools.sh"
ensure_buildah

go_binary() {  # go_binary NAME PACKAGE MODULE VERSION: prints the binary, built once
  # Through a wrapper module, as hack/build-control-plane.sh does: `go install PKG@V` refuses a
  # module whose go.mod has replace directives (etcd's has).
  local dir="$K/build/$1-$4" bin="$K/bin/$1-$4/$1"
  if [[ ! -x $bin ]]; then
    log "building $1 $4 from the Go module proxy"
    mkdir -p "$dir" "$(dirname "$bin")"
    printf 'module accelerate-operator.io/kind/%s\n\ngo 1.24\n\nrequire %s %s\n' "$1" "$3" "$4" >"$dir/go.mod"
    printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$2" >"$dir/tools.go"
    (cd "$dir" && GOFLAGS=-mod=mod go mod tidy >&2 &&
      CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$bin.tmp" "$2" >&2)
    mv "$bin.tmp" "$bin"
  fi
  echo "$bin"
}

ensure_iptables_base() {  # what kube-proxy, podnet and the storage helper run on
  bah inspect --type image "$IPTABLES_BASE" >/dev/null 2>&1 && return
  local tar="$K/rootfs/debian-iptables.tar" ctr
  debian_rootfs "$tar" iptables nftables iproute2 conntrack ca-certificates
  ctr=$(bah from scratch)
  bah add "$ctr" "$tar" / >&2
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  bah commit --rm "$ctr" "$IPTABLES_BASE" >&2
}

image_with() {  # image_with IMAGE BASE ENTRYPOINT FILE...: BASE with each FILE in /usr/local/bin
  local image=$1 base=$2 entrypoint=$3 ctr f; shift 3
  ctr=$(bah from "$base")
  for f in "$@"; do bah copy --chmod 0755 "$ctr" "$f" "/usr/local/bin/$(basename "$f")" >/dev/null; done
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    ${entrypoint:+--entrypoint "$entrypoint"} "$ctr"
  bah rmi "$image" >/dev/null 2>&1 || true  # the build it replaces, left untagged otherwise
  bah commit --rm "$ctr" "$image" >&2
}

# ---------------------------------------------------------------- inputs
BIN=$(EXTRA_BINARIES=kubeadm "$ROOT/hack/build-control-plane.sh" | tail -n1)
KIND_SRC=$(go mod download -json "sigs.k8s.io/kind@$KIND_VERSION" |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
KIND_FILES="$KIND_SRC/images/base/files"
SANDBOX=$(sed -n 's/^ *sandbox_image = "\(.*\)"/\1/p' "$KIND_FILES/etc/containerd/config.toml")
mapfile -t KUBEADM_IMAGES < <("$BIN/kubeadm" config images list --kubernetes-version "$K8S_VERSION")
kubeadm_image() {  # kubeadm_image NAME: the reference kubeadm uses for its image NAME
  local ref
  for ref in "${KUBEADM_IMAGES[@]}"; do [[ ${ref%:*} == */$1 ]] && { echo "$ref"; return; }; done
  die "kubeadm $K8S_VERSION lists no $1 image (${KUBEADM_IMAGES[*]})"
}
ETCD_REF=$(kubeadm_image etcd)
COREDNS_REF=$(kubeadm_image coredns)
cluster_images=$(COREDNS_VERSION="${COREDNS_REF##*:}" COREDNS_OWN_DEPENDENCIES=1 "$ROOT/hack/build-cluster-images.sh")
PAUSE_IMAGE=$(sed -n 1p <<<"$cluster_images"); COREDNS_IMAGE=$(sed -n 2p <<<"$cluster_images")
# etcd at the version kubeadm runs (its image tag is VERSION-0), which may differ from the local
# cluster's (hack/build-control-plane.sh).
etcd_version=${ETCD_REF##*:}
ETCD=$(go_binary etcd go.etcd.io/etcd/server/v3 go.etcd.io/etcd/server/v3 "v${etcd_version%-*}")
CRICTL=$(go_binary crictl sigs.k8s.io/cri-tools/cmd/crictl sigs.k8s.io/cri-tools "$CRICTL_VERSION")
PROVISIONER=$(go_binary local-path-provisioner github.com/rancher/local-path-provisioner \
  github.com/rancher/local-path-provisioner "$LOCAL_PATH_VERSION")
ensure_iptables_base

inputs=$({
  sha256sum "$BIN"/{kubeadm,kubelet,kubectl,kube-apiserver,kube-controller-manager,kube-scheduler,kube-proxy} \
    "$ETCD" "$CRICTL" "$PROVISIONER" "${BASH_SOURCE[0]}" "$ROOT"/hack/kind/* | cut -d' ' -f1
  for image in "$PAUSE_IMAGE" "$COREDNS_IMAGE" "$IPTABLES_BASE"; do
    bah inspect --type image --format '{{.FromImageID}}' "$image"
  done
  echo "$KIND_VERSION ${NODE_PACKAGES[*]}"
} | sha256sum | cut -c1-16)
if [[ $(docker image inspect --format '{{index .Config.Labels "accelerate-operator.io/inputs"}}' \
        "$NODE_IMAGE" 2>/dev/null) == "$inputs" ]]; then
  echo "$NODE_IMAGE"
  exit 0
fi
log "building $NODE_IMAGE (inputs $inputs)"

# ---------------------------------------------------------------- the images kubeadm and kind run
WORK="$K/build/node"
rm -rf "$WORK"
mkdir -p "$WORK/archives"
trap 'rm -rf "$WORK"' EXIT

archive() {  # archive IMAGE REFERENCE: IMAGE from buildah's storage as a docker archive named REFERENCE
  bah push --quiet "$1" "docker-archive:$WORK/archives/$(tr '/:' '__' <<<"$2").tar:$2" >&2
}

coredns_image() {  # coredns_image IMAGE: ours, with CoreDNS's own image's file capability
  # kubeadm runs CoreDNS as the image's non-root user with NET_BIND_SERVICE added and no privilege
  # escalation: port 53 is bound through the binary's file capability, which CoreDNS's Dockerfile
  # sets (setcap). The local cluster binds it through a sysctl instead (hack/manifests/coredns.yaml).
  local ctr mnt
  ctr=$(bah from "$COREDNS_IMAGE")
  mnt=$(bah mount "$ctr")
  setcap cap_net_bind_service=+ep "$mnt/coredns"
  bah umount "$ctr" >/dev/null
  bah rmi "$1" >/dev/null 2>&1 || true
  bah commit --rm "$ctr" "$1" >&2
}

node_images() {  # every image the node runs, as docker archives under the names it runs them by
  local name
  for name in kube-apiserver kube-controller-manager kube-scheduler; do
    image_with "$LOCAL/$name:$K8S_VERSION" scratch "" "$BIN/$name"
    archive "$LOCAL/$name:$K8S_VERSION" "$(kubeadm_image "$name")"
  done
  image_with "$LOCAL/kube-proxy:$K8S_VERSION" "$IPTABLES_BASE" "" "$BIN/kube-proxy"
  archive "$LOCAL/kube-proxy:$K8S_VERSION" "$(kubeadm_image kube-proxy)"
  image_with "$LOCAL/etcd:$etcd_version" scratch "" "$ETCD"
  archive "$LOCAL/etcd:$etcd_version" "$ETCD_REF"
  coredns_image "$LOCAL/coredns:${COREDNS_REF##*:}"
  archive "$LOCAL/coredns:${COREDNS_REF##*:}" "$COREDNS_REF"
  archive "$PAUSE_IMAGE" "$SANDBOX"
  image_with "$PODNET_IMAGE" "$IPTABLES_BASE" '["/usr/local/bin/podnet.sh"]' \
    "$BIN/kubectl" "$ROOT/hack/kind/podnet.sh"
  archive "$PODNET_IMAGE" "$PODNET_IMAGE"
  image_with "$PROVISIONER_IMAGE" scratch "" "$PROVISIONER"
  archive "$PROVISIONER_IMAGE" "$PROVISIONER_IMAGE"
  image_with "$HELPER_IMAGE" "$IPTABLES_BASE" ""
  archive "$HELPER_IMAGE" "$HELPER_IMAGE"
}

storage_manifest() {  # kind's own local-path-provisioner manifest, naming the images built here
  python3 - "$KIND_SRC/pkg/build/nodeimage/const_storage.go" "$PROVISIONER_IMAGE" "$HELPER_IMAGE" <<'PY'
import re, sys
source, provisioner, helper = sys.argv[1:]
text = open(source).read()
text = text.replace("` + storageProvisionerImage + `", provisioner)
text = text.replace("` + storageHelperImage + `", helper)
print(re.search(r"const defaultStorageManifest = `([^`]*)`", text).group(1))
PY
}

node_rootfs() {  # node_rootfs DIR: kindest/base's file system, then what `kind build node-image` adds
  local r=$1 tar
  tar="$K/rootfs/node-$(sha256sum <<<"${NODE_PACKAGES[*]}" | cut -c1-12).tar"
  debian_rootfs "$tar" "${NODE_PACKAGES[@]}"
  mkdir -p "$r"
  tar -C "$r" -xf "$tar"
  rm -rf "${r:?}"/dev/*  # the engine makes /dev
  cp -r "$KIND_FILES/." "$r/"  # kindest/base's COPY steps: scripts 0755, the rest 0644
  find "$r/kind" "$r/LICENSES" "$r/etc/containerd" "$r/etc/default" "$r/etc/sysctl.d" \
    "$r/etc/systemd/system" "$r/etc/crictl.yaml" -type f -exec chmod 0644 {} +
  chmod 0755 "$r"/usr/local/bin/* "$r/kind/bin" "$r"/kind/bin/*
  # kindest/base's RUN steps; containerd, runc and the CNI plugins are Debian's, where kind's
  # files expect its own builds.
  # shellcheck disable=SC2016  # expanded in the chroot
  chroot "$r" /bin/sh -euc '
    find /lib/systemd/system/sysinit.target.wants/ -name systemd-tmpfiles-setup.service -delete
    rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \
      /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \
      /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/*
    echo ReadKMsg=no >>/etc/systemd/journald.conf
    ln -sf /lib/systemd/systemd /sbin/init
    systemctl enable kubelet.service containerd.service undo-mount-hacks.service
    systemctl mask systemd-binfmt.service
    mkdir -p /etc/kubernetes/manifests /opt/cni/bin
    ln -sf /usr/bin/containerd /usr/local/bin/containerd
    for p in host-local loopback ptp portmap; do ln -sf "/usr/lib/cni/$p" "/opt/cni/bin/$p"; done
    ctr oci spec \
      | jq ".hooks.createContainer[.hooks.createContainer|length] |= . + {\"path\": \"/kind/bin/mount-product-files.sh\"}" \
      | jq "del(.process.rlimits)" >/etc/containerd/cri-base.json' >&2
  install -m 0755 "$BIN/kubeadm" "$BIN/kubelet" "$BIN/kubectl" "$r/usr/bin/"
  install -m 0755 "$CRICTL" "$r/usr/local/bin/crictl"
  printf %s "$K8S_VERSION" >"$r/kind/version"
  mkdir -p "$r/kind/manifests"
  sed "s|@PODNET_IMAGE@|$PODNET_IMAGE|" "$ROOT/hack/kind/default-cni.yaml" >"$r/kind/manifests/default-cni.yaml"
  storage_manifest >"$r/kind/manifests/default-storage.yaml"
}

preload() {  # preload DIR: the archives into DIR's containerd store, unpacked on first use as kind's are
  local r=$1 sock="$WORK/containerd.sock" pid a ref i
  cat >"$WORK/containerd.toml" <<TOML
version = 2
root = "$r/var/lib/containerd"
state = "$WORK/containerd-state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.internal.v1.opt"]
[grpc]
  address = "$sock"
TOML
  containerd --config "$WORK/containerd.toml" >"$WORK/containerd.log" 2>&1 &
  pid=$!
  for ((i = 0; i < 100; i++)); do ctr -a "$sock" version >/dev/null 2>&1 && break; sleep 0.2; done
  for a in "$WORK"/archives/*.tar; do
    ctr -a "$sock" -n k8s.io images import --no-unpack --all-platforms "$a" >/dev/null
  done
  # Pinned, as kind pins them: the kubelet's image garbage collection never removes them.
  for ref in $(ctr -a "$sock" -n k8s.io images ls -q); do
    ctr -a "$sock" -n k8s.io images label "$ref" io.cri-containerd.pinned=pinned >/dev/null
  done
  kill "$pid"
  wait "$pid" || true
}

node_images
node_rootfs "$WORK/rootfs"
preload "$WORK/rootfs"
log "importing $NODE_IMAGE into the engine at $DOCKER_HOST"
tar -C "$WORK/rootfs" --numeric-owner -cf - . | docker import \
  --change 'ENV container=docker' --change 'STOPSIGNAL SIGRTMIN+3' \
  --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' \
  --change "LABEL accelerate-operator.io/inputs=$inputs" - "$NODE_IMAGE" >&2
docker image prune --force --filter label=accelerate-operator.io/inputs >&2  # the image it replaced
echo "$NODE_IMAGE"
