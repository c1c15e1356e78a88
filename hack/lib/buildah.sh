# Sourced by the image scripts: one buildah storage for the project, cached outside the repository
# ($ACCELERATE_OPERATOR_CACHE/containers), so layers survive between runs and clones. Overlay is
# the fast driver; STORAGE_DRIVER=vfs is the fallback for kernels or filesystems without it.
CACHE_DIR="${ACCELERATE_OPERATOR_CACHE:-$HOME/.cache/accelerate-operator}"
BUILDAH_ROOT="${BUILDAH_ROOT:-$CACHE_DIR/containers/storage}"
BUILDAH_RUNROOT="${BUILDAH_RUNROOT:-/run/accelerate-operator/containers}"
STORAGE_DRIVER="${STORAGE_DRIVER:-overlay}"
# The base every local image starts from: Debian's own packages, no registry needed.
LOCAL_BASE_IMAGE="localhost/accelerate-operator/debian-python:bookworm"

bah() {  # buildah with the project's storage
  buildah --root "$BUILDAH_ROOT" --runroot "$BUILDAH_RUNROOT" --storage-driver "$STORAGE_DRIVER" "$@"
}

ensure_buildah() {
  command -v buildah >/dev/null && return
  command -v apt-get >/dev/null || { echo "error: buildah is needed (apt-get install buildah)" >&2; exit 1; }
  echo ">> installing buildah" >&2
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq buildah >&2
}
