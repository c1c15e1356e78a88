"""`accelerate-job submit`: what was asked for, read once from the command line into a typed
SubmitOptions, then created (or printed with --dry-run)."""

from __future__ import annotations

import argparse
import random
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accelerate_trainer.config import ConfigError

from . import session
from .code import CodeArchive, pack_code
from .errors import InvalidConfig
from .render import dump
from .request import context_namespace
from .session import CommandError, Terminal
from .submission import build_job, build_submission, files_named_by


def default_job_name(script: str, suffix: str) -> str:
    """`train.py` -> `train-<suffix>`: a DNS-1035 label, as the CRD requires."""
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(script).stem.lower()).strip("-")[:40] or "job"
    if not stem[0].isalpha():
        stem = f"job-{stem}"
    return f"{stem}-{suffix}"


@dataclass(frozen=True)
class SubmitOptions:
    """What `submit` was asked to run, read once from the command line."""

    config: str
    image: str
    script: str
    script_args: tuple[str, ...]
    nodes: int | None  # None: not written, the operator takes it from the YAML
    procs_per_node: int | str | None
    gpus: int | None
    env: tuple[tuple[str, str], ...]
    backoff_limit: int | None
    workdir: str | None = None
    requirements: str | None = None
    in_image: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SubmitOptions:
        script_args = list(args.script_args)
        if script_args[:1] == ["--"]:  # `submit ... SCRIPT -- ARGS`
            script_args = script_args[1:]
        return cls(config=args.config, image=args.image, script=args.script,
                   script_args=tuple(script_args), nodes=args.nodes,
                   procs_per_node=args.procs_per_node, gpus=args.gpus, env=tuple(args.env),
                   backoff_limit=args.backoff_limit, workdir=args.workdir,
                   requirements=args.requirements, in_image=args.in_image)

    def pack(self) -> CodeArchive | None:
        """The code to ship, packed; None when there is nothing (the script is in the image).
        Raises CodeError (CodeTooLarge) before anything is created."""
        if self.in_image and self.workdir:
            raise CommandError("--workdir ships a folder to run SCRIPT from, but --in-image "
                               "says SCRIPT is already in the image; drop one of them")
        if self.in_image and not self.requirements:
            return None
        return pack_code(None if self.in_image else self.script, workdir=self.workdir,
                         requirements=self.requirements)

    def build_job(self, name: str, namespace: str,
                  code: CodeArchive | None = None) -> dict[str, Any]:
        """The job; with shipped code its script is the one in the workspace."""
        script = code.entrypoint if code is not None and code.entrypoint else self.script
        return build_job(name=name, namespace=namespace, image=self.image, script=script,
                         script_args=self.script_args, num_nodes=self.nodes,
                         nproc_per_node=self.procs_per_node, env=dict(self.env),
                         gpus_per_node=self.gpus, backoff_limit=self.backoff_limit)


def _read_config(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise CommandError(f"cannot read --config {path} ({error.strerror}); write one with "
                           f"`accelerate config --config_file {path}`") from None
    except UnicodeDecodeError as error:
        raise _not_utf8(f"--config {path}", error,
                        f"the YAML `accelerate config --config_file {path}` writes") from None


def _not_utf8(path: str | Path, error: UnicodeDecodeError, what: str) -> CommandError:
    return CommandError(f"cannot read {path}: it is not UTF-8 text ({error.reason} at byte "
                        f"{error.start}); it should be {what}")


def _read_named_files(config: str, config_yaml: str) -> dict[str, str]:
    """The files the YAML names (its DeepSpeed JSON), read beside it, to ship with it."""
    files = {}
    for named in files_named_by(config_yaml):
        path = Path(config).parent / named
        if path.is_file():
            try:
                files[path.name] = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as error:
                raise _not_utf8(path, error, f"the file {config} names ({named})") from None
    return files


def _print_dry_run(options: SubmitOptions, args: argparse.Namespace, job: dict[str, Any],
                   config_yaml: str, files: dict[str, str], code: CodeArchive | None,
                   term: Terminal) -> int:
    namespace = job["metadata"]["namespace"]
    try:
        submission = build_submission(job, config_yaml, namespace, files, code)
    except ConfigError as error:
        raise CommandError(f"{options.config}: {error}") from None
    dump(submission.objects(), session.output_kind(args, "yaml"), term.out)
    return 0


def cmd_submit(args: argparse.Namespace, term: Terminal) -> int:
    options = SubmitOptions.from_args(args)
    config_yaml = _read_config(options.config)
    files = _read_named_files(options.config, config_yaml)
    code = options.pack()  # too big for a ConfigMap: an error before anything is created
    name = args.name or default_job_name(
        options.script, "".join(random.choices(string.ascii_lowercase + string.digits, k=5)))
    client = None if args.dry_run else session.client(args)
    namespace = client.namespace if client else (
        args.namespace or context_namespace(args.kubeconfig, args.context))
    job = options.build_job(name, namespace, code)
    if client is None:
        return _print_dry_run(options, args, job, config_yaml, files, code, term)
    try:
        created = client.submit(job, config_yaml=config_yaml, config_files=files, code=code)
    except InvalidConfig as error:
        raise CommandError(f"{options.config}: {error}") from None
    if args.output:
        dump([created], args.output.kind, term.out)
        return 0
    term.out.write(f"acceleratejob/{name} submitted in namespace {client.namespace}\n")
    if code is not None:
        term.err.write(f"shipped {len(code.files)} file(s), {len(code.data) / 1024:.0f} KiB "
                       f"packed, in configmap/{name}-code\n")
    term.err.write(f"follow it: {term.prog} status {name} -n {client.namespace} --watch\n")
    return 0
