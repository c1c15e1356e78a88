"""The user's shipped code: check and unpack it into the writable workspace, and install its
requirements, before `accelerate launch` (spec.code; `accelerate-job submit` ships it).

The archive comes whole or not at all: it is one ConfigMap key (the kubelet mounts it
atomically, and the container does not start until it can), its sha256 must be the one the job
names (a ConfigMap edited after submit is refused), and every member must be a plain file or
folder inside the workspace. Any failure raises before anything is launched, so a script never
runs against half a tree. The requirements are installed into a virtualenv of the workspace that
sees the image's packages (a .pth file), so what the image already holds is not installed again,
a version the requirements change is installed beside it (pip leaves the image's read-only
environment alone: `--prefix` would try to uninstall from it), and pip's output is in the pod's
log."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import site
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

# The virtualenv the requirements go into, inside the workspace.
PACKAGES_DIR = ".accelerate-venv"
IMAGE_PTH = "_accelerate_image.pth"


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


def build_pip_argv(requirements: str, python: str) -> list[str]:
    """pip of the overlay virtualenv (pip itself comes from the image, through the .pth)."""
    return [python, "-m", "pip", "install", "--no-input", "-r", requirements]


def site_dirs(prefix: Path) -> list[str]:
    """The folders under `prefix` where packages go (site-packages, or dist-packages on
    Debian's Python), for PYTHONPATH."""
    return sorted(str(p) for pattern in ("lib/python*/site-packages", "lib/python*/dist-packages",
                                         "local/lib/python*/site-packages",
                                         "local/lib/python*/dist-packages")
                  for p in prefix.glob(pattern) if p.is_dir())


def make_overlay_venv(venv: Path, image_site: Sequence[str]) -> list[str]:
    """A virtualenv without pip whose site-packages lists the image's own (`image_site`) in a
    .pth file: pip run from it counts the image's packages as installed, but as outside its
    environment, so it never uninstalls them. Returns its site-packages folders."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   capture_output=True)
    packages = site_dirs(venv)
    if not packages:
        raise RequirementsError(f"the virtualenv {venv} has no site-packages folder")
    Path(packages[0], IMAGE_PTH).write_text("".join(f"{path}\n" for path in image_site))
    return packages


def install_requirements(code: ShippedCode, environ: Mapping[str, str]) -> list[str]:
    """Run pip on the shipped requirements, its output going to the pod's log; returns the
    folders to put on PYTHONPATH. Raises RequirementsError when pip fails."""
    workspace = Path(code.workspace)
    requirements = workspace / code.requirements
    if not requirements.is_file():
        raise RequirementsError(
            f"spec.code.requirements names {code.requirements}, which the shipped code does "
            "not hold; submit the job again with --requirements FILE")
    venv = workspace / PACKAGES_DIR
    tmp = workspace / ".tmp"
    tmp.mkdir(exist_ok=True)
    try:
        packages = make_overlay_venv(venv, site.getsitepackages())
    except (OSError, subprocess.CalledProcessError) as error:
        raise RequirementsError(f"cannot create a virtualenv in {venv} for the requirements "
                                f"({error})") from None
    argv = build_pip_argv(str(requirements), str(venv / "bin" / "python"))
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
    return packages


def workspace_env(code: ShippedCode, packages: Sequence[str],
                  environ: Mapping[str, str]) -> dict[str, str]:
    """The env the launch gets: the workspace (so the script's own modules import from any
    folder of it) and the installed requirements first on PYTHONPATH; their scripts on PATH."""
    env = {"PYTHONPATH": os.pathsep.join(
        [*packages, code.workspace, *filter(None, [environ.get("PYTHONPATH")])])}
    bin_dir = Path(code.workspace) / PACKAGES_DIR / "bin"
    if packages and bin_dir.is_dir():
        env["PATH"] = os.pathsep.join([str(bin_dir), *filter(None, [environ.get("PATH")])])
    return env
