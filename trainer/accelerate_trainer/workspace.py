"""The user's shipped code: check and unpack it into the writable workspace, and install its
requirements, before `accelerate launch` (spec.code; `accelerate-job submit` ships it).

The archive comes whole or not at all: it is one ConfigMap key (the kubelet mounts it
atomically, and the container does not start until it can), its sha256 must be the one the job
names (a ConfigMap edited after submit is refused), and every member must be a plain file or
folder inside the workspace. Any failure raises before anything is launched, so a script never
runs against half a tree. The requirements are installed with `pip install --prefix` into the
workspace (the image's own environment is read-only and stays as it is; what it already holds is
not installed again), with pip's output in the pod's log."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import subprocess
import sys
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .contract import (
    CODE_ARCHIVE_KEY,
    CODE_MOUNT_PATH,
    ENV_CODE_ARCHIVE,
    ENV_CODE_REQUIREMENTS,
    ENV_CODE_SHA256,
    ENV_CODE_WORKSPACE,
    WORKSPACE_DIR,
)

log = logging.getLogger("accelerate_trainer")

# Where `pip install --prefix` puts the requirements, inside the workspace.
PACKAGES_DIR = ".accelerate-packages"


class CodeError(ValueError):
    """The shipped code cannot be used: missing, changed since submit, or unsafe to unpack."""


class RequirementsError(RuntimeError):
    """Installing the shipped requirements failed."""


@dataclass(frozen=True)
class ShippedCode:
    """What spec.code told the pod, through its env."""

    archive: str
    sha256: str
    workspace: str = WORKSPACE_DIR
    requirements: str | None = None


def parse_shipped_code(environ: Mapping[str, str]) -> ShippedCode | None:
    """None when the job ships no code (the script is in the image)."""
    sha256 = environ.get(ENV_CODE_SHA256)
    if not sha256:
        return None
    return ShippedCode(
        archive=environ.get(ENV_CODE_ARCHIVE) or f"{CODE_MOUNT_PATH}/{CODE_ARCHIVE_KEY}",
        sha256=sha256,
        workspace=environ.get(ENV_CODE_WORKSPACE) or WORKSPACE_DIR,
        requirements=environ.get(ENV_CODE_REQUIREMENTS) or None,
    )


def _safe_name(name: str) -> str:
    path = PurePosixPath(name)
    if path.is_absolute() or ".." in path.parts or not path.parts:
        raise CodeError(f"the code archive holds {name!r}, a path outside the workspace; "
                        "submit it again with accelerate-job")
    return str(path)


def unpack_code(code: ShippedCode) -> list[str]:
    """Check the archive against its sha256 and unpack it into the workspace; returns the file
    names. Raises CodeError, saying what to do, before writing anything when the archive is
    missing, changed or unsafe."""
    try:
        data = Path(code.archive).read_bytes()
    except OSError as error:
        raise CodeError(
            f"cannot read the shipped code {code.archive} ({error.strerror}); the job's "
            "spec.code.configMap must hold the key "
            f"{CODE_ARCHIVE_KEY} that `accelerate-job submit` wrote") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != code.sha256:
        raise CodeError(
            f"the shipped code {code.archive} has sha256 {digest}, not the {code.sha256} "
            "spec.code.sha256 names: its ConfigMap was changed after submit. Submit the job "
            "again instead of editing the ConfigMap")
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            members = archive.getmembers()
            for member in members:
                _safe_name(member.name)
                if not (member.isfile() or member.isdir()):
                    raise CodeError(f"the code archive holds {member.name!r}, which is not a "
                                    "plain file or folder; submit it again with accelerate-job")
            return _extract(archive, members, Path(code.workspace))
    except (tarfile.TarError, EOFError, OSError) as error:
        raise CodeError(f"cannot unpack the shipped code {code.archive} into "
                        f"{code.workspace}: {error}; the workspace must be writable (an "
                        "emptyDir, which the operator adds when the template mounts nothing "
                        "there)") from None


def _extract(archive: tarfile.TarFile, members: Sequence[tarfile.TarInfo],
             workspace: Path) -> list[str]:
    names = []
    workspace.mkdir(parents=True, exist_ok=True)
    for member in members:
        target = workspace / _safe_name(member.name)
        if member.isdir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        source = archive.extractfile(member)
        target.write_bytes(source.read() if source else b"")
        target.chmod(0o755 if member.mode & 0o111 else 0o644)
        names.append(_safe_name(member.name))
    return names


def build_pip_argv(requirements: str, prefix: str, python: str = sys.executable) -> list[str]:
    """`pip install --prefix`: unlike --target it keeps what the image already has (torch is
    not downloaded again) and, unlike --user, it works inside the image's virtualenv."""
    return [python, "-m", "pip", "install", "--no-input", "--prefix", prefix,
            "-r", requirements]


def site_dirs(prefix: Path) -> list[str]:
    """The folders under `prefix` where pip put packages (site-packages, or dist-packages on
    Debian's Python), for PYTHONPATH."""
    return sorted(str(p) for pattern in ("lib/python*/site-packages", "lib/python*/dist-packages",
                                         "local/lib/python*/site-packages",
                                         "local/lib/python*/dist-packages")
                  for p in prefix.glob(pattern) if p.is_dir())


def install_requirements(code: ShippedCode, environ: Mapping[str, str]) -> list[str]:
    """Run pip on the shipped requirements, its output going to the pod's log; returns the
    folders to put on PYTHONPATH. Raises RequirementsError when pip fails."""
    workspace = Path(code.workspace)
    requirements = workspace / code.requirements
    if not requirements.is_file():
        raise RequirementsError(
            f"spec.code.requirements names {code.requirements}, which the shipped code does "
            "not hold; submit the job again with --requirements FILE")
    prefix = workspace / PACKAGES_DIR
    argv = build_pip_argv(str(requirements), str(prefix))
    tmp = workspace / ".tmp"
    tmp.mkdir(exist_ok=True)
    log.info("installing %s: %s", code.requirements, " ".join(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    env = {**environ, "TMPDIR": str(tmp), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    try:
        returncode = subprocess.call(argv, env=env, cwd=workspace)  # output: the pod's log
    except OSError as error:
        raise RequirementsError(f"cannot run pip ({error.strerror})") from None
    if returncode != 0:
        raise RequirementsError(
            f"pip install -r {code.requirements} failed with exit code {returncode} (its "
            "output is in this pod's log); fix the requirements, or make sure the package "
            "index is reachable from the cluster (PIP_INDEX_URL in the job's env)")
    return site_dirs(prefix)


def workspace_env(code: ShippedCode, site: Sequence[str],
                  environ: Mapping[str, str]) -> dict[str, str]:
    """The env the launch gets: the workspace (so the script's own modules import from any
    folder of it) and the installed requirements first on PYTHONPATH; their scripts on PATH."""
    env = {"PYTHONPATH": os.pathsep.join(
        [*site, code.workspace, *filter(None, [environ.get("PYTHONPATH")])])}
    bin_dir = Path(code.workspace) / PACKAGES_DIR / "bin"
    if site and bin_dir.is_dir():
        env["PATH"] = os.pathsep.join([str(bin_dir), *filter(None, [environ.get("PATH")])])
    return env
