"""Build what `accelerate-job submit` (and AccelerateJobClient.submit) create: the AccelerateJob,
the ConfigMap holding the user's accelerate YAML, and the ConfigMap carrying the user's packed
code (code.py packs it). Pure: no clock, no randomness, no API calls; the CLI picks the name, the
client sends the objects. Each object is built once, by `prepare_submission`, `use_code` and
`build_code_configmap`, whether it is then sent or printed (--dry-run)."""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accelerate_operator.api import SpecError, parse_job
from accelerate_operator.constants import API_VERSION, GPU_RESOURCE, KIND
from accelerate_operator.labels import job_labels
from accelerate_operator.resources.configmap import prepare_config
from accelerate_trainer.config import (
    ConfigError,
    deepspeed_file,
    parse_accelerate_yaml,
)
from accelerate_trainer.contract import CODE_ARCHIVE_KEY, JOB_NAME_LABEL

from .code import CodeArchive

DEFAULT_CONFIG_KEY = "accelerate.yaml"
TRAINER_CONTAINER = "trainer"


def config_source_name(job_name: str) -> str:
    """The user's accelerate YAML; `<job>-accelerate-config` is the operator's rendered copy."""
    return f"{job_name}-accelerate-yaml"


def build_job(
    *,
    name: str,
    namespace: str,
    image: str,
    script: str,
    script_args: Sequence[str] = (),
    num_nodes: int | None = None,
    nproc_per_node: int | str | None = None,
    config_map: str | None = None,
    config_key: str = DEFAULT_CONFIG_KEY,
    env: Mapping[str, str] | None = None,
    gpus_per_node: int | None = None,
    backoff_limit: int | None = None,
) -> dict[str, Any]:
    """An AccelerateJob running `accelerate-trainer SCRIPT ARGS...` in `image`; its accelerate
    YAML is read from ConfigMap `config_map` (default: `<name>-accelerate-yaml`). A topology
    number left as None is not written: the operator takes it from the YAML."""
    container = _trainer_container(image, [script, *script_args], env, gpus_per_node)
    spec: dict[str, Any] = {
        **({"numNodes": num_nodes} if num_nodes is not None else {}),
        **({"numProcPerNode": nproc_per_node} if nproc_per_node is not None else {}),
        "accelerateConfigFrom": {"configMapKeyRef": {
            "name": config_map or config_source_name(name), "key": config_key}},
        "template": {"spec": {"containers": [container]}},
    }
    if backoff_limit is not None:
        spec["runPolicy"] = {"backoffLimit": backoff_limit}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def _trainer_container(image: str, args: list[str], env: Mapping[str, str] | None,
                       gpus_per_node: int | None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": TRAINER_CONTAINER,
        "image": image,
        "command": ["accelerate-trainer"],
        "args": args,
    }
    if env:
        container["env"] = [{"name": key, "value": value} for key, value in env.items()]
    if gpus_per_node:
        container["resources"] = {"limits": {GPU_RESOURCE: gpus_per_node}}
    return container


def build_config_source(job_name: str, namespace: str, config_yaml: str,
                        name: str | None = None,
                        key: str = DEFAULT_CONFIG_KEY,
                        files: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ConfigMap holding the user's accelerate YAML as written (the operator renders it),
    and the files it names (a DeepSpeed JSON) beside it, by file name."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name or config_source_name(job_name),
            "namespace": namespace,
            "labels": job_labels(job_name),
        },
        "data": {key: config_yaml, **dict(files or {})},
    }


def use_config_source(job: Mapping[str, Any]) -> tuple[dict[str, Any], str, str]:
    """A copy of `job` that reads its accelerate YAML from a ConfigMap, and that ConfigMap's name
    and key: the job's own accelerateConfigFrom if it has one, else `<name>-accelerate-yaml`
    (an inline accelerateConfig is dropped: the YAML given to submit replaces it)."""
    job = copy.deepcopy(dict(job))
    spec = job.setdefault("spec", {})
    ref = (spec.get("accelerateConfigFrom") or {}).get("configMapKeyRef") or {}
    name = ref.get("name") or config_source_name(job["metadata"]["name"])
    key = ref.get("key") or DEFAULT_CONFIG_KEY
    spec.pop("accelerateConfig", None)
    spec["accelerateConfigFrom"] = {"configMapKeyRef": {"name": name, "key": key}}
    return job, name, key


def files_named_by(config_yaml: str) -> list[str]:
    """The paths of files the YAML needs shipped with it: the DeepSpeed JSON of a DEEPSPEED
    config (relative paths are relative to the YAML's folder)."""
    try:
        named = deepspeed_file(parse_accelerate_yaml(config_yaml))
    except ConfigError:
        return []  # check_accelerate_yaml says what is wrong
    return [named] if named else []


def check_accelerate_yaml(config_yaml: str, spec: Mapping[str, Any],
                          files: Mapping[str, str] | None = None) -> None:
    """Raise accelerate_trainer.config.ConfigError when the YAML (with `files`, those shipped
    beside it) cannot work for a job with this spec, before anything is created: the operator's
    own render, so it fails the job with the same message."""
    config = parse_accelerate_yaml(config_yaml, source="the accelerate config")
    spec = {key: value for key, value in spec.items() if key != "accelerateConfigFrom"}
    body = {"metadata": {"name": "submit"},
            "spec": {**spec, "accelerateConfig": config,
                     "accelerateConfigFiles": dict(files or {})}}
    try:
        prepare_config(parse_job(body), None)
    except SpecError as error:
        raise ConfigError(str(error)) from None


def prepare_submission(job: Mapping[str, Any], config_yaml: str, namespace: str,
                       files: Mapping[str, str] | None = None,
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job, reading its accelerate YAML from a ConfigMap, and that ConfigMap (the YAML and
    `files`, those shipped beside it), in `namespace`: what submit creates (the ConfigMap first).
    Raises ConfigError when the YAML cannot work for the job."""
    check_accelerate_yaml(config_yaml, job.get("spec") or {}, files)
    job, configmap_name, key = use_config_source(job)
    configmap = build_config_source(job["metadata"]["name"], namespace, config_yaml,
                                    configmap_name, key, files)
    return job, configmap


def code_configmap_name(job_name: str) -> str:
    return f"{job_name}-code"


def use_code(job: Mapping[str, Any], code: CodeArchive) -> dict[str, Any]:
    """A copy of `job` whose spec.code names the ConfigMap `<name>-code` and the code's sha256
    (and requirements file); its trainer container's args are left as they are."""
    job = copy.deepcopy(dict(job))
    spec = job.setdefault("spec", {})
    spec["code"] = {"configMap": code_configmap_name(job["metadata"]["name"]),
                    "sha256": code.sha256,
                    **({"requirements": code.requirements} if code.requirements else {})}
    return job


def build_code_configmap(job: Mapping[str, Any], code: CodeArchive) -> dict[str, Any]:
    """The ConfigMap carrying the packed code, owned by `job` when it has a uid (the created
    job: the ConfigMap is never without an owner, so garbage collection takes it with the job;
    no controller or blockOwnerDeletion, which would need more rights than creating a job).

    Immutable, so the kubelets do not watch it. It has no job-name label: the operator never
    reads it (the pods mount it), so its server-filtered watches never carry up to 1 MiB per
    job."""
    metadata = job["metadata"]
    labels = {key: value for key, value in job_labels(metadata["name"]).items()
              if key != JOB_NAME_LABEL}
    manifest: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": job["spec"]["code"]["configMap"],
            "namespace": metadata["namespace"],
            "labels": {**labels, "app.kubernetes.io/component": "code"},
        },
        "binaryData": {CODE_ARCHIVE_KEY: base64.b64encode(code.data).decode("ascii")},
        "immutable": True,
    }
    if metadata.get("uid"):
        manifest["metadata"]["ownerReferences"] = [{
            "apiVersion": job.get("apiVersion", API_VERSION), "kind": job.get("kind", KIND),
            "name": metadata["name"], "uid": metadata["uid"]}]
    return manifest


@dataclass(frozen=True)
class Submission:
    """Everything `submit` sends, in the order it sends it: the accelerate YAML's ConfigMap
    (when a YAML is given), the job, then the code's ConfigMap (when code is shipped; the
    owner reference to the created job is added once the server has given it a uid)."""

    config: dict[str, Any] | None
    job: dict[str, Any]
    code: dict[str, Any] | None

    def objects(self) -> list[dict[str, Any]]:
        return [o for o in (self.config, self.job, self.code) if o is not None]


def build_submission(job: Mapping[str, Any], config_yaml: str | None, namespace: str,
                     files: Mapping[str, str] | None = None,
                     code: CodeArchive | None = None) -> Submission:
    """What submit sends, built once, for the real submit and `--dry-run` alike. Pure; raises
    ConfigError when the YAML cannot work for the job."""
    body = use_code(job, code) if code is not None else copy.deepcopy(dict(job))
    configmap = None
    if config_yaml is not None:
        body, configmap = prepare_submission(body, config_yaml, namespace, files)
    return Submission(configmap, body,
                      build_code_configmap(body, code) if code is not None else None)


def owned_by(manifest: Mapping[str, Any], job: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `manifest` owned by the created `job` (garbage-collected with it)."""
    owned = copy.deepcopy(dict(manifest))
    owned["metadata"]["ownerReferences"] = [{
        "apiVersion": job.get("apiVersion", API_VERSION), "kind": job.get("kind", KIND),
        "name": job["metadata"]["name"], "uid": job["metadata"]["uid"]}]
    return owned
