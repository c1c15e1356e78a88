"""The ConfigMap `<job>-accelerate-config`: the user's accelerate YAML with the topology filled in,
and the files it names (a DeepSpeed JSON) beside it.

The user's own keys are kept. The topology (num_machines, num_processes, main_process_port) is
what `api.with_config` resolved from the spec and the YAML; a value the YAML contradicts is an
error, checked by the trainer's shared checks. machine_rank and main_process_ip are per pod, so
they are left to each pod's command line.

Files travel with the config: the other keys of the ConfigMap that holds the YAML, and
spec.accelerateConfigFiles, are written beside `config.yaml` and mounted with it. A path in the
config that names one of them (relative to the config's folder, or by its file name wherever the
path pointed when the user wrote it, since ConfigMap keys are flat) is rewritten to where it is
mounted. What can be checked without the image is checked here, before any pod exists: the
DeepSpeed JSON is there, parses, and fits the YAML and the job; no value the spec already tells
accelerate would drop is left unsaid (accelerate_trainer.ignored: a refusal, or a warning the job
carries in `JobSpec.config_warnings` for its status). Pure: no API calls."""

from __future__ import annotations

import dataclasses
import hashlib
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from accelerate_trainer.config import (
    ConfigError,
    check_job_fits,
    deepspeed_file,
    distributed_type,
    file_references,
    is_cpu_job,
    parse_accelerate_yaml,
    resolve_config_path,
)
from accelerate_trainer.contract import CONFIG_KEY, CONFIG_MOUNT_PATH, REPORT_CA_KEY
from accelerate_trainer.deepspeed_checks import parse_deepspeed_json
from accelerate_trainer.ignored import check_ignored_values, gpu_ids_of

from ..api import JobSpec, SpecError, with_config
from ..constants import GPU_RESOURCE
from ..elastic import check_elastic
from ..labels import job_labels
from ..naming import configmap_name
from .reserved import check_pod_template

PER_POD_KEYS = ("machine_rank", "main_process_ip")


@dataclass(frozen=True)
class ConfigSource:
    """The ConfigMap spec.accelerateConfigFrom names, as read: the YAML and its other keys."""

    name: str
    key: str
    text: str
    files: Mapping[str, str] = field(default_factory=dict)
    binary_files: Mapping[str, str] = field(default_factory=dict)  # base64, as the API has them

    @property
    def label(self) -> str:
        return f"ConfigMap {self.name!r} key {self.key!r}"


def collect_files(job: JobSpec, source: ConfigSource | None) -> dict[str, str]:
    """The text files shipped beside the YAML: the source ConfigMap's other keys, then
    spec.accelerateConfigFiles. A name given twice, or one that would hide the rendered
    config.yaml, is an error naming it."""
    files: dict[str, str] = {}
    if source:
        for name, text in source.files.items():
            if name == source.key:
                continue
            if name == CONFIG_KEY:
                raise ConfigError(
                    f"ConfigMap {source.name!r} has a key {CONFIG_KEY!r} beside the accelerate "
                    f"YAML {source.key!r}; that name is the rendered config the pods read: "
                    "rename the key (and the path in the config)"
                )
            files[name] = text
    for name, text in job.config_files.items():
        if name in files or (source and name in source.binary_files):
            raise ConfigError(
                f"file {name!r} is both a key of ConfigMap {source.name!r} and in "
                "spec.accelerateConfigFiles; keep one"
            )
        files[name] = text
    return files


def _mount_dirs(job: JobSpec) -> list[str]:
    containers = (job.template.get("spec") or {}).get("containers") or [{}]
    return [m["mountPath"] for m in containers[0].get("volumeMounts") or [] if m.get("mountPath")]


def _place(path: str, shipped: set[str], mounts: list[str]) -> tuple[str, bool]:
    """Where the pod finds the file `path` names, and whether it is a shipped file."""
    in_folder = resolve_config_path(path, CONFIG_MOUNT_PATH)
    if posixpath.dirname(in_folder) == CONFIG_MOUNT_PATH and posixpath.basename(
            in_folder) in shipped:
        return in_folder, True
    in_volume = any(in_folder == m or in_folder.startswith(m.rstrip("/") + "/") for m in mounts)
    name = posixpath.basename(path)
    if name in shipped and not in_volume:
        return f"{CONFIG_MOUNT_PATH}/{name}", True
    return in_folder, False


def render_accelerate_config(
    job: JobSpec,
    user_config: Mapping[str, Any],
    files: Mapping[str, str] | None = None,
    *,
    binary_names: frozenset[str] = frozenset(),
    shipped_in: str = "spec.accelerateConfigFiles",
) -> dict[str, Any]:
    """The config the pods read. Raises accelerate_trainer.config.ConfigError when it
    contradicts the job, names a DeepSpeed JSON that is missing, malformed or does not fit, or
    holds a value accelerate would drop and so train otherwise than it says.
    `shipped_in` says where a missing file should be added."""
    return _render(job, user_config, files, binary_names=binary_names, shipped_in=shipped_in)[0]


def gpu_limit(job: JobSpec) -> int | None:
    """The trainer container's nvidia.com/gpu limit (requests, where only they are given): the
    GPUs each pod really gets. None when it names none or not a whole number."""
    containers = (job.template.get("spec") or {}).get("containers") or [{}]
    resources = containers[0].get("resources") or {}
    value = ((resources.get("limits") or {}).get(GPU_RESOURCE)
             or (resources.get("requests") or {}).get(GPU_RESOURCE))
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _render(
    job: JobSpec,
    user_config: Mapping[str, Any],
    files: Mapping[str, str] | None = None,
    *,
    binary_names: frozenset[str] = frozenset(),
    shipped_in: str = "spec.accelerateConfigFiles",
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """render_accelerate_config, and the warnings for the values accelerate would drop
    harmlessly."""
    files = dict(files or {})
    rendered = {key: value for key, value in user_config.items() if key not in PER_POD_KEYS}
    deepspeed_json, deepspeed_source = _place_files(
        job, user_config, rendered, files, set(files) | binary_names, shipped_in)
    check_job_fits(rendered, num_nodes=job.num_nodes, num_processes=job.world_size,
                   master_port=job.master_port, deepspeed_json=deepspeed_json,
                   deepspeed_source=deepspeed_source)
    rendered.setdefault("compute_environment", "LOCAL_MACHINE")
    rendered.setdefault("distributed_type", "NO" if job.world_size == 1 else "MULTI_GPU")
    # The per-pod keys the render drops are checked too: a warning says they are replaced.
    warnings = check_ignored_values({**user_config, **rendered}, gpus_per_pod=gpu_limit(job),
                                    nproc_per_node=job.nproc_per_node)
    if gpu_ids_of(rendered) is not None and is_cpu_job(rendered):
        # A CPU job uses no GPU, and on one machine accelerate refuses fewer than two ids: the
        # key goes, with the warning above saying so.
        del rendered["gpu_ids"]
    check_elastic(job, rendered, deepspeed_json, deepspeed_source)
    rendered["num_machines"] = job.num_nodes
    rendered["num_processes"] = job.world_size
    rendered["main_process_port"] = job.master_port
    if job.elastic is not None:
        # The group of an elastic job runs at several sizes: the trainer passes both on the
        # command line at the size it runs at, and the YAML must not say another.
        del rendered["num_machines"], rendered["num_processes"]
    if distributed_type(rendered) == "DEEPSPEED" and job.num_nodes > 1:
        deepspeed = dict(rendered.get("deepspeed_config") or {})
        deepspeed["deepspeed_multinode_launcher"] = "standard"
        rendered["deepspeed_config"] = deepspeed
    return rendered, tuple(warnings)


def _place_files(job: JobSpec, user_config: Mapping[str, Any], rendered: dict[str, Any],
                 files: Mapping[str, str], shipped: set[str],
                 shipped_in: str) -> tuple[dict | None, str]:
    """Rewrite, in `rendered`, every path the config names to where the pods find it; returns
    the DeepSpeed JSON it names, parsed (None when not shipped), and how to name it in errors."""
    mounts = _mount_dirs(job)
    deepspeed_json, deepspeed_source = None, "the DeepSpeed config"
    named_deepspeed = deepspeed_file(user_config)
    for dotted, path in file_references(user_config):
        placed, is_shipped = _place(path, shipped, mounts)
        block, _, key = dotted.rpartition(".")
        holder = dict(rendered[block]) if block else rendered
        holder[key] = placed
        if block:
            rendered[block] = holder
        if dotted != "deepspeed_config.deepspeed_config_file" or path != named_deepspeed:
            continue
        deepspeed_source = f"{dotted} {path!r}"
        if is_shipped and posixpath.basename(placed) in files:
            deepspeed_json = parse_deepspeed_json(files[posixpath.basename(placed)],
                                                  f"{deepspeed_source} (shipped as {placed})")
        elif not posixpath.isabs(path):
            raise ConfigError(
                f"{deepspeed_source} is not shipped with the config: the pods would find no "
                f"{placed} and every rank would crash reading it. Add "
                f"{posixpath.basename(path)!r} to {shipped_in} (shipped now: "
                f"{', '.join(sorted(shipped)) or 'none'}), or give an absolute path into one "
                "of the pod's volumes"
            )
    return deepspeed_json, deepspeed_source


# libyaml's emitter, PyYAML's C binding (in its wheels; the pure-Python one where it is missing):
# 0.06-0.08 ms per config against 0.3-0.6 ms, at every job's creation (docs/performance.md, "What
# the investigations found"). The same text for every config of tests/accelerate_corpus;
# only the folding of long quoted strings can differ, and it reads back the same.
_YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def build_configmap(job: JobSpec, rendered_config: Mapping[str, Any],
                    files: Mapping[str, str] | None = None,
                    binary_files: Mapping[str, str] | None = None) -> dict[str, Any]:
    manifest: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": configmap_name(job.name),
            "namespace": job.namespace,
            "labels": job_labels(job.name),
            "ownerReferences": [job.owner_reference],
        },
        "data": {CONFIG_KEY: yaml.dump(dict(rendered_config), Dumper=_YAML_DUMPER,
                                       sort_keys=False),
                 **dict(files or {})},
    }
    if binary_files:
        manifest["binaryData"] = dict(binary_files)
    return manifest


def prepare_config(job: JobSpec, source: ConfigSource | None) -> tuple[JobSpec, dict[str, Any]]:
    """From the job and the ConfigMap it reads its YAML from (None for an inline config): the
    job with its topology resolved and `config_warnings` set (the values accelerate would drop
    harmlessly, for a Warning event and the ConfigWarnings condition), and the ConfigMap
    `<job>-accelerate-config` to create. Raises SpecError or ConfigError, naming the file (or
    the field of the spec) to fix, when the job cannot run."""
    check_pod_template(job)
    if source:
        user_config = parse_accelerate_yaml(source.text, source=source.label)
        shipped_in = f"ConfigMap {source.name!r} (a key beside {source.key!r})"
    else:
        user_config = dict(job.accelerate_config or {})
        shipped_in = "spec.accelerateConfigFiles"
    try:
        job = with_config(job, user_config)
        files = collect_files(job, source)
        binary = {k: v for k, v in (source.binary_files if source else {}).items()
                  if k not in (CONFIG_KEY, source.key)}
        rendered, warnings = _render(job, user_config, files, binary_names=frozenset(binary),
                                     shipped_in=shipped_in)
    except (ConfigError, SpecError) as error:
        if source:  # say which file the user has to fix
            raise type(error)(f"{source.label}: {error}") from None
        raise
    if source:
        warnings = tuple(f"{source.label}: {warning}" for warning in warnings)
    job = dataclasses.replace(job, config_warnings=warnings)
    return job, build_configmap(job, rendered, files, binary)


def with_report_ca(configmap: dict[str, Any], bundle: str | None) -> dict[str, Any]:
    """The ConfigMap with the CA bundle of the operator's report endpoint
    (contract.REPORT_CA_KEY, mounted into the pods' report volume); as it is without one."""
    if not bundle:
        return configmap
    return {**configmap, "data": {**configmap.get("data", {}), REPORT_CA_KEY: bundle}}


def ca_digest(bundle: str | None) -> str:
    """What the operator's index keeps of the CA bundle a job's ConfigMap holds ("" for none):
    enough to tell whether it is the current one, a few bytes per job."""
    return hashlib.sha256(bundle.encode()).hexdigest()[:32] if bundle else ""


def read_ca_digest(configmap: Mapping[str, Any]) -> str:
    return ca_digest((configmap.get("data") or {}).get(REPORT_CA_KEY))
