"""Exec shim for one container of the local node agent (dev/test infrastructure, not a runtime).

Run as `python -I -S container_init.py SPEC.json` by the agent. It joins the pod sandbox's network
and UTS namespaces, enters a private mount namespace, bind-mounts the pod's volumes, /etc/hosts
and the termination-message file, then execs the container's command with the prepared
environment, so the agent's child pid IS the container process. It imports only the standard
library (started once per container, it must be quick) and never talks to the API server.
"""

import ctypes
import json
import os
import socket
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000

libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _setns(path: str, nstype: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(libc.setns(fd, nstype), f"setns {path}")
    finally:
        os.close(fd)


def _mount(src: str | None, dst: str, flags: int) -> None:
    _check(libc.mount(src.encode() if src else None, dst.encode(), None, flags, None),
           f"mount {src} on {dst}")


def _ensure_target(dst: str, is_file: bool) -> None:
    # Mount points are created on the host's filesystem (the pod has no root filesystem of its own).
    if is_file:
        os.makedirs(os.path.dirname(dst) or "/", exist_ok=True)
        if not os.path.exists(dst):
            open(dst, "a").close()
    else:
        os.makedirs(dst, exist_ok=True)


def _under(path: str, mount_point: str) -> bool:
    mount_point = mount_point.rstrip("/") or "/"
    return path == mount_point or path.startswith(mount_point.rstrip("/") + "/")


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    term_log = spec.get("termination_log_host")
    # A volume may be mounted over a host directory the pod still needs: the operator's chart
    # mounts an emptyDir at /tmp, and a checkout, the agent's cache or the venv the pod runs
    # can live under /tmp. So every mount source, the venv and the termination log are opened
    # before any mount, and used through their file descriptors afterwards.
    term_fd = os.open(term_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if term_log else None
    # The environments the pod runs: each PATH entry, its prefix for a .../bin (a venv).
    path_dirs = [d for d in spec["env"].get("PATH", "").split(":") if d.startswith("/")]
    prefixes = {os.path.dirname(d) if d.endswith("/bin") else d for d in path_dirs}
    keep: dict[str, int] = {}
    try:
        if spec.get("netns"):
            _setns(spec["netns"], CLONE_NEWNET)
        if spec.get("utsns"):
            _setns(spec["utsns"], CLONE_NEWUTS)
            socket.sethostname(spec["hostname"])
        _check(libc.unshare(CLONE_NEWNS), "unshare mount namespace")
        # Private propagation: our bind mounts must never leak back to the host.
        _mount(None, "/", MS_REC | MS_PRIVATE)
        # Opened inside the new mount namespace: a bind mount from another namespace's mount
        # is refused (EINVAL).
        keep = {p: os.open(p, os.O_PATH) for p in sorted(prefixes) if os.path.isdir(p)}
        source_fds = [os.open(m["src"], os.O_PATH) for m in spec["mounts"]]
        for m, fd in zip(spec["mounts"], source_fds, strict=True):
            _ensure_target(m["dst"], m["file"])
            _mount(f"/proc/self/fd/{fd}", m["dst"], MS_BIND | MS_REC)
            if m.get("ro"):
                _mount(None, m["dst"], MS_BIND | MS_REMOUNT | MS_RDONLY)
            os.close(fd)
        for path, fd in keep.items():
            if any(_under(path, m["dst"]) and not _under(m["dst"], path) for m in spec["mounts"]):
                os.makedirs(path, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", path, MS_BIND | MS_REC)
        cwd = spec.get("cwd") or "/"
        os.makedirs(cwd, exist_ok=True)
        os.chdir(cwd)
    except OSError as e:
        _fail(term_fd, f"local node agent: container setup failed: {e}", 128)
    for fd in keep.values():
        os.close(fd)
    argv = spec["argv"]
    try:
        os.execvpe(argv[0], argv, spec["env"])
    except FileNotFoundError:
        _fail(term_fd, f"local node agent: executable {argv[0]!r} not found in PATH "
                        f"{spec['env'].get('PATH', '')}", 127)
    except OSError as e:
        _fail(term_fd, f"local node agent: cannot exec {argv[0]!r}: {e}", 126)


def _fail(term_fd: int | None, message: str, code: int) -> None:
    sys.stderr.write(message + "\n")
    if term_fd is not None:
        os.write(term_fd, message.encode()[:4096])
    os._exit(code)


if __name__ == "__main__":
    main()
