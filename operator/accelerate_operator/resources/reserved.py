"""The volume names and mount paths build_pod (pods.py) adds to a job's pods: a template or
spec.checkpoint that takes one is refused before any child exists, naming the field, the name or
path and the fix, since the API server would refuse every pod with a message that names neither.
Pure; apart from pods.py so that rendering the config (configmap.prepare_config, which calls
it, also for `accelerate-job submit`) needs none of the pod builder."""

from __future__ import annotations

import posixpath

from accelerate_trainer.contract import (
    CODE_MOUNT_PATH,
    CONFIG_MOUNT_PATH,
    REPORT_DIR,
    WORKSPACE_DIR,
)

from ..api import JobSpec, SpecError
from ..constants import CODE_VOLUME, CONFIG_VOLUME, REPORT_VOLUME, SHM_VOLUME, WORKSPACE_VOLUME

SHM_PATH = "/dev/shm"


def _added_volumes(job: JobSpec, mounted: set[str]) -> dict[str, str]:
    """The volumes build_pod adds, by name, with what each holds; `mounted`: the trainer's own
    mount paths (a template that mounts /dev/shm or /workspace gets no volume of ours there)."""
    added = {CONFIG_VOLUME: "the rendered accelerate config", REPORT_VOLUME: "the report token"}
    if SHM_PATH not in mounted:
        added[SHM_VOLUME] = f"the memory-backed {SHM_PATH}"
    if job.code:
        added[CODE_VOLUME] = "spec.code's archive"
        if WORKSPACE_DIR not in mounted:
            added[WORKSPACE_VOLUME] = "the workspace spec.code is unpacked into"
    return added


def _read_only_mounts(job: JobSpec) -> dict[str, str]:
    """Where build_pod mounts a volume of its own on the trainer, read-only: no mount may be
    there or below."""
    mounts = {CONFIG_MOUNT_PATH: "the rendered accelerate config", REPORT_DIR: "the report token"}
    if job.code:
        mounts[CODE_MOUNT_PATH] = "spec.code's archive"
    return mounts


def _under(path: str, mounts: dict[str, str]) -> str | None:
    """The mount of `mounts` that `path` is, or lies below."""
    path = posixpath.normpath(path)
    return next((m for m in mounts if path == m or path.startswith(m + "/")), None)


def check_pod_template(job: JobSpec) -> None:
    """Raises SpecError, naming the field, the name or path and the fix, where the template or
    spec.checkpoint takes a volume name or mount path build_pod adds: the API server would
    refuse every pod, with a message that names neither."""
    spec = job.template.get("spec") or {}
    mounts = [m.get("mountPath") or "" for m in spec["containers"][0].get("volumeMounts") or []]
    added = _added_volumes(job, {posixpath.normpath(path) for path in mounts if path})
    for index, volume in enumerate(spec.get("volumes") or []):
        if volume.get("name") in added:
            raise SpecError(
                f"spec.template.spec.volumes[{index}].name {volume['name']!r} is reserved: the "
                f"operator adds a volume of that name ({added[volume['name']]}); rename the "
                "volume, and its volumeMounts")
    ours = _read_only_mounts(job)
    for index, path in enumerate(mounts):
        if taken := _under(path, ours):
            raise SpecError(
                f"spec.template.spec.containers[0].volumeMounts[{index}].mountPath {path!r} is "
                f"reserved: the operator mounts {ours[taken]} at {taken}; mount the volume at "
                "another path")
    if job.checkpoint:
        _check_checkpoint_path(job, ours)


def _check_checkpoint_path(job: JobSpec, ours: dict[str, str]) -> None:
    """The checkpoint volume never takes a path of ours: none of the read-only mounts, nor
    /dev/shm, nor with spec.code /workspace (the shared volume as the workspace would put every
    pod's code and virtualenv in one folder, and the code beside the checkpoints)."""
    path = job.checkpoint.mount_path
    exact = {SHM_PATH: f"the memory-backed {SHM_PATH}"}
    if job.code:
        exact[WORKSPACE_DIR] = "the workspace spec.code is unpacked into"
    normal = posixpath.normpath(path)
    taken = _under(path, ours) or (normal if normal in exact else None)
    if taken:
        what = {**ours, **exact}[taken]
        raise SpecError(f"spec.checkpoint.mountPath {path!r} is reserved: the operator mounts "
                        f"{what} at {taken}; set another path (the default is /checkpoints)")
