"""Pack the user's code for `accelerate-job submit`: the script, or a small working directory
(without what `.gitignore` / `.accelerateignore` exclude), and a requirements file, into one
deterministic gzip tarball that travels in a ConfigMap the job owns (submission.py builds it).

Deterministic: the same tree gives the same bytes (sorted names, no times, owners or local
modes beyond the executable bit), so its sha256 names the code. Too big for a ConfigMap is an
error here, before anything is created, saying what to do instead. Reads local files only: no
API calls."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import AccelerateJobError

# Kubernetes refuses a ConfigMap over 1 MiB (data and binaryData together); the rest of the
# object (names, labels, the owner reference) needs a little of it.
CONFIGMAP_LIMIT = 1024 * 1024
MAX_ARCHIVE_BYTES = CONFIGMAP_LIMIT - 64 * 1024
# Past this much uncompressed, no compression gets under the limit: stop reading early.
MAX_TREE_BYTES = 64 * 1024 * 1024
IGNORE_FILES = (".gitignore", ".accelerateignore")
# Never worth shipping: version control, caches, virtual environments.
DEFAULT_EXCLUDES = (
    ".git/", ".hg/", ".svn/", "__pycache__/", "*.py[cod]", ".venv/", "venv/", ".env/",
    ".tox/", ".nox/", ".mypy_cache/", ".pytest_cache/", ".ruff_cache/", ".ipynb_checkpoints/",
    "*.egg-info/", ".DS_Store",
)
WHAT_TO_DO = ("leave out what the job does not need (list it in .accelerateignore), bake the "
              "code into the trainer image and run it with --in-image PATH, or put large files "
              "(data, weights) on a volume of the job's template (a PersistentVolumeClaim)")


class CodeError(AccelerateJobError):
    """The code cannot be shipped as asked (a missing script, a script outside --workdir)."""


class CodeTooLarge(CodeError):
    """The packed code does not fit in a ConfigMap."""


@dataclass(frozen=True)
class CodeArchive:
    """The packed code and where the pod finds the script and requirements in it."""

    data: bytes  # a gzip tarball
    files: tuple[str, ...]  # its members, sorted
    entrypoint: str | None  # the script, relative to the workspace; None: it is in the image
    requirements: str | None = None  # the pip requirements file, relative to the workspace

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


# ---- .gitignore-style patterns -----------------------------------------------------------------


@dataclass(frozen=True)
class _Rule:
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool


def _translate(pattern: str) -> str:
    """A gitignore glob as a regex over a relative POSIX path."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("/**", i) and i + 3 == n:
            out.append("/.*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        elif pattern[i] == "\\" and i + 1 < n:
            out.append(re.escape(pattern[i + 1]))
            i += 2
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


def parse_ignore(lines: Iterable[str]) -> list[_Rule]:
    """The rules of a .gitignore: `#` comments, `!` re-includes, a trailing `/` matches folders
    only, a pattern with a `/` is anchored at the top, `*`, `?`, `[...]` and `**`."""
    rules = []
    for raw in lines:
        line = raw.rstrip("\n").rstrip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        line = line[1:] if negate else line
        dir_only = line.endswith("/")
        line = line.rstrip("/")
        if not line:
            continue
        anchored = "/" in line
        body = _translate(line.lstrip("/"))
        regex = f"^{body}$" if anchored else f"^(?:.*/)?{body}$"
        rules.append(_Rule(re.compile(regex), negate, dir_only))
    return rules


def is_ignored(path: str, is_dir: bool, rules: Sequence[_Rule]) -> bool:
    """Whether `path` (relative, POSIX) is excluded: the last rule that matches decides."""
    ignored = False
    for rule in rules:
        if (is_dir or not rule.dir_only) and rule.regex.match(path):
            ignored = not rule.negate
    return ignored


# ---- packing -----------------------------------------------------------------------------------


def _ignore_rules(root: Path) -> list[_Rule]:
    lines = list(DEFAULT_EXCLUDES)
    for name in IGNORE_FILES:
        path = root / name
        if path.is_file():
            lines += path.read_text(errors="replace").splitlines()
    return parse_ignore(lines)


def _walk(root: Path) -> dict[str, Path]:
    """The files of `root` that are not excluded, by relative POSIX path. Folders excluded are
    not entered; symbolic links to files are shipped as the files, links to folders are not
    followed."""
    rules = _ignore_rules(root)
    found: dict[str, Path] = {}
    for folder, dirs, files in os.walk(root):
        base = Path(folder).relative_to(root)
        dirs[:] = sorted(d for d in dirs if not is_ignored(
            (base / d).as_posix(), True, rules) and not (Path(folder) / d).is_symlink())
        for name in sorted(files):
            rel = (base / name).as_posix()
            if not is_ignored(rel, False, rules) and (Path(folder) / name).is_file():
                found[rel] = Path(folder) / name
    return found


def _inside(path: Path, root: Path) -> str | None:
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:
        return None


def _find_script(script: str, root: Path | None) -> Path:
    path = Path(script).expanduser()
    if not path.is_file() and root is not None and not path.is_absolute():
        path = root / script  # SCRIPT may be given relative to --workdir
    if not path.is_file():
        raise CodeError(
            f"SCRIPT {script} is not a file on this machine; submit ships it from here. To run "
            "a script that is already inside the image, put --in-image before it (for example "
            "--in-image /opt/accelerate/examples/train.py)")
    return path


def _human(size: int) -> str:
    return f"{size / 1024 / 1024:.1f} MiB" if size >= 1024 * 1024 else f"{size / 1024:.0f} KiB"


def _too_large(what: str, sizes: dict[str, int], packed: int | None) -> CodeTooLarge:
    largest = sorted(sizes.items(), key=lambda item: (-item[1], item[0]))[:5]
    listing = ", ".join(f"{name} ({_human(size)})" for name, size in largest)
    amount = (f"{_human(packed)} compressed" if packed is not None
              else f"more than {_human(MAX_TREE_BYTES)} before compression")
    return CodeTooLarge(
        f"{what} is {amount}, more than the {_human(MAX_ARCHIVE_BYTES)} a job can carry (the code "
        f"travels in a ConfigMap, which Kubernetes caps at {_human(CONFIGMAP_LIMIT)}); nothing was "
        f"created. Largest files: {listing}. To ship it: {WHAT_TO_DO}")


def build_tarball(files: dict[str, bytes], executable: frozenset[str] = frozenset()) -> bytes:
    """A gzip tarball of `files` (relative POSIX path -> content), the same bytes every time."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size = len(files[name])
            info.mode = 0o755 if name in executable else 0o644
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            tar.addfile(info, io.BytesIO(files[name]))
    packed = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=packed, mtime=0, compresslevel=9) as gz:
        gz.write(raw.getvalue())
    return packed.getvalue()


def pack_code(script: str | None, *, workdir: str | None = None,
              requirements: str | None = None) -> CodeArchive:
    """Pack `script` (None: it is in the image; only the requirements travel), with `workdir`
    the whole folder it lies in, and `requirements`. Raises CodeError when a file is missing or
    the script lies outside `workdir`, CodeTooLarge when the result cannot fit in a ConfigMap."""
    root = Path(workdir).expanduser().resolve() if workdir else None
    if root is not None and not root.is_dir():
        raise CodeError(f"--workdir {workdir} is not a folder on this machine")
    paths = _walk(root) if root is not None else {}
    entrypoint = None
    if script is not None:
        found = _find_script(script, root)
        if root is None:
            entrypoint = found.name
            paths[entrypoint] = found
        else:
            entrypoint = _inside(found, root)
            if entrypoint is None:
                raise CodeError(f"SCRIPT {script} is not inside --workdir {workdir}; move it "
                                "there, or pick the folder that holds it")
            if entrypoint not in paths:
                raise CodeError(f"SCRIPT {script} is excluded by the ignore rules of "
                                f"--workdir {workdir} ({', '.join(IGNORE_FILES)}); re-include "
                                f"it with a line !{entrypoint}")
    requirements_path = _place_requirements(requirements, root, paths)
    sizes = {name: path.stat().st_size for name, path in paths.items()}
    what = f"--workdir {workdir} ({len(paths)} files)" if root else "the code to ship"
    if sum(sizes.values()) > MAX_TREE_BYTES:
        raise _too_large(what, sizes, None)
    files = {name: path.read_bytes() for name, path in paths.items()}
    executable = frozenset(name for name, path in paths.items() if os.access(path, os.X_OK))
    data = build_tarball(files, executable)
    if len(data) > MAX_ARCHIVE_BYTES:
        raise _too_large(what, sizes, len(data))
    return CodeArchive(data=data, files=tuple(sorted(files)), entrypoint=entrypoint,
                       requirements=requirements_path)


def _place_requirements(requirements: str | None, root: Path | None,
                        paths: dict[str, Path]) -> str | None:
    """Where the requirements file is in the archive: in place when --workdir ships it, else
    added at the top under its own name."""
    if requirements is None:
        return None
    path = Path(requirements).expanduser()
    if not path.is_file():
        raise CodeError(f"--requirements {requirements} is not a file on this machine")
    inside = _inside(path, root) if root is not None else None
    if inside is not None and inside in paths:
        return inside
    name = PurePosixPath(path.name).name
    if name in paths and paths[name].resolve() != path.resolve():
        raise CodeError(f"--requirements {requirements} would be shipped as {name}, but the "
                        f"working directory already has a different {name}; rename one")
    paths[name] = path
    return name
