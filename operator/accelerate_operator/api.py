"""Parse an AccelerateJob body into frozen dataclasses. Pure: no API calls.

The CRD's schema and CEL rules reject most bad input at admission; what reaches here is checked
again only where the operator alone can know (a ConfigMap's content, `auto` processes).

The topology (nodes, processes per node, rendezvous port) may come from the spec or from the
accelerate YAML: a field the spec leaves out takes the YAML's value (`resolve_topology`), and a
field both give must agree (the shared config checks reject the job otherwise). Once resolved it
is recorded in `status.topology`, which later passes read back, so a job whose YAML lives in a
ConfigMap does not need that ConfigMap read on every pass."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from accelerate_trainer.contract import CONFIG_KEY

from .constants import API_VERSION, GPU_RESOURCE, KIND, QUEUE_LABEL

DEFAULT_MASTER_PORT = 29500
# The CRD's ranges (minimum, maximum) of the spec fields the YAML's topology keys stand for.
MAX_NODES = 1024
CONFIG_RANGES = {
    "num_machines": (1, MAX_NODES, "spec.numNodes"),
    "num_processes": (1, MAX_NODES * 1024, "spec.numNodes x spec.numProcPerNode"),
    "main_process_port": (1024, 65535, "spec.masterPort"),
}
# spec.elastic.shrinkAfterSeconds when left out (the CRD's default too).
DEFAULT_SHRINK_AFTER_SECONDS = 120
# Pods are named <job>-<index>, a DNS label: at most 63 characters.
MAX_HOSTNAME = 63
# ConfigMap keys (the file names mounted beside the accelerate YAML).
FILE_NAME = re.compile(r"^[-._a-zA-Z0-9]+$")


class SpecError(ValueError):
    """The job cannot run as written; the message names the field and the fix."""


@dataclass(frozen=True)
class ConfigMapKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class RunPolicy:
    backoff_limit: int = 3
    permanent_exit_codes: tuple[int, ...] = ()
    active_deadline_seconds: int | None = None
    ttl_seconds_after_finished: int | None = None
    clean_pod_policy: str = "Running"
    suspend: bool = False
    # How long a Running group may go without a log line or progress report from rank 0, or a
    # new group without all its pods running, before it is Stalled and restarted; None: never.
    stall_timeout_seconds: int | None = None
    # How long a node holding one of the group's pods may be NotReady or unreachable before the
    # group restarts without it (group.py).
    node_lost_timeout_seconds: int = 10
    # A PodDisruptionBudget (minAvailable numNodes) over each running group: voluntary drains
    # wait until the job finishes instead of stopping it.
    pod_disruption_budget: bool = False
    # A failed training process restarts the processes inside the running pods (every pod of
    # the group on a healthy node), not the pods (supervise.py, group.py).
    restart_in_place: bool = True
    # How long the group's pods may take to start (scheduling, image pulls, init containers)
    # before the job fails, reason WaitingTimeoutExceeded (startup.py); 0: wait forever.
    waiting_timeout_seconds: int = 900


@dataclass(frozen=True)
class Checkpoint:
    volume_name: str
    mount_path: str = "/checkpoints"


@dataclass(frozen=True)
class Code:
    """spec.code: the user's code, shipped in a ConfigMap the job owns (accelerate-job submit)."""

    config_map: str
    sha256: str
    requirements: str | None = None


@dataclass(frozen=True)
class Elastic:
    """spec.elastic: how far the job may shrink when nodes cannot be placed (elastic.py decides
    the sizes and the accumulation at each)."""

    min_nodes: int
    # The accumulation at the size the job wants (numNodes); the operator passes the one for
    # the size the group runs at, so the global batch stays.
    gradient_accumulation_steps: int
    shrink_after_seconds: int = DEFAULT_SHRINK_AFTER_SECONDS
    # The size the job wants, once the group runs at another (elastic.at_size); else None.
    wanted_nodes: int | None = None


@dataclass(frozen=True)
class TopologyRequest:
    """The topology fields as the spec gives them; None where the spec leaves one out."""

    num_nodes: int | None = None
    nproc_per_node: int | str | None = None  # an integer or "auto"
    master_port: int | None = None


@dataclass(frozen=True)
class JobSpec:
    """One AccelerateJob as the builders need it."""

    name: str
    namespace: str
    uid: str
    generation: int
    num_nodes: int
    nproc_per_node: int
    master_port: int
    template: Mapping[str, Any]
    accelerate_config: Mapping[str, Any] | None = None
    config_from: ConfigMapKeyRef | None = None
    run_policy: RunPolicy = field(default_factory=RunPolicy)
    checkpoint: Checkpoint | None = None
    requested: TopologyRequest = field(default_factory=TopologyRequest)
    # False while the topology still depends on a ConfigMap this pass has not read.
    topology_resolved: bool = True
    # spec.accelerateConfigFiles: file name -> content, mounted beside the accelerate YAML.
    config_files: Mapping[str, str] = field(default_factory=dict)
    code: Code | None = None
    # Values of the accelerate config that accelerate would drop harmlessly (a TPU-only key on
    # a GPU job...), found when the config is rendered (resources/configmap.prepare_config);
    # lifecycle.py names them in a Warning event and the ConfigWarnings condition.
    config_warnings: tuple[str, ...] = ()
    elastic: Elastic | None = None
    # The Kueue LocalQueue of a queued job (label kueue.x-k8s.io/queue-name), else None.
    queue_name: str | None = None

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.nproc_per_node

    @property
    def wanted_nodes(self) -> int:
        """numNodes, whatever size an elastic job's group runs at (elastic.at_size)."""
        return (self.elastic.wanted_nodes if self.elastic else None) or self.num_nodes

    @property
    def owner_reference(self) -> dict[str, Any]:
        return {"apiVersion": API_VERSION, "kind": KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}


def resolve_nproc_per_node(value: Any, template: Mapping[str, Any]) -> int:
    """An integer, or "auto": the trainer container's GPU limit, else 1."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise SpecError("spec.numProcPerNode must be at least 1")
        return value
    if value == "auto":
        containers = template.get("spec", {}).get("containers") or [{}]
        limits = (containers[0].get("resources") or {}).get("limits") or {}
        gpus = limits.get(GPU_RESOURCE)
        try:
            return max(int(gpus), 1) if gpus is not None else 1
        except (TypeError, ValueError):
            raise SpecError(
                f"spec.template's first container has {GPU_RESOURCE} limit {gpus!r}, "
                "not an integer; numProcPerNode \"auto\" needs a whole number of GPUs"
            ) from None
    raise SpecError(f"spec.numProcPerNode must be a positive integer or \"auto\", got {value!r}")


def _config_int(config: Mapping[str, Any], key: str) -> int | None:
    """A topology key of the YAML, in the range the CRD gives the spec field it stands for:
    a ConfigMap's YAML never passes admission."""
    value = config.get(key)
    if value is None:
        return None
    low, high, field_name = CONFIG_RANGES[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpecError(f"accelerate config key {key}={value!r} must be an integer from {low} "
                        f"to {high}, the range of {field_name}: fix {key} in the accelerate "
                        "config")
    return value


def resolve_topology(
    requested: TopologyRequest,
    config: Mapping[str, Any] | None,
    template: Mapping[str, Any],
    recorded: Mapping[str, Any] | None = None,
) -> tuple[int, int, int]:
    """(nodes, processes per node, master port): each from the spec where it gives one, else
    from `recorded` (status.topology, what an earlier pass resolved), else from the accelerate
    YAML (num_machines, num_processes / num_machines, main_process_port), else 1, 1, 29500.
    Where both the spec and the YAML give a value and they differ, the spec's is returned here
    and the shared config checks reject the job."""
    config = config or {}
    recorded = recorded or {}
    yaml_nodes = _config_int(config, "num_machines")
    yaml_port = _config_int(config, "main_process_port")
    if requested.num_nodes is not None:
        nodes = requested.num_nodes
    elif recorded.get("numNodes"):
        nodes = int(recorded["numNodes"])
    else:
        nodes = yaml_nodes or 1
    procs = _resolve_procs(requested, config, template, recorded, nodes)
    if requested.master_port is not None:
        port = requested.master_port
    elif recorded.get("masterPort"):
        port = int(recorded["masterPort"])
    else:
        port = yaml_port or DEFAULT_MASTER_PORT
    return nodes, procs, port


def _resolve_procs(requested: TopologyRequest, config: Mapping[str, Any],
                   template: Mapping[str, Any], recorded: Mapping[str, Any], nodes: int) -> int:
    """Processes per node: the spec's, the recorded one, or the YAML's total over `nodes`."""
    yaml_total = _config_int(config, "num_processes")
    if requested.nproc_per_node is not None:
        return resolve_nproc_per_node(requested.nproc_per_node, template)
    if recorded.get("numProcPerNode"):
        return int(recorded["numProcPerNode"])
    if yaml_total is None:
        return 1
    if yaml_total % nodes:
        raise SpecError(
            f"accelerate config num_processes={yaml_total} (the TOTAL over all machines) does "
            f"not divide evenly over {nodes} machine(s); every machine runs the same number: "
            "fix num_processes, or set spec.numProcPerNode"
        )
    return yaml_total // nodes


def with_config(job: JobSpec, config: Mapping[str, Any]) -> JobSpec:
    """`job` with its topology resolved against the accelerate YAML it will run (read from its
    ConfigMap, or inline). Raises SpecError when the YAML's numbers cannot make a topology."""
    nodes, procs, port = resolve_topology(job.requested, config, job.template)
    _check_name_fits(job.name, nodes)
    return dataclasses.replace(job, num_nodes=nodes, nproc_per_node=procs, master_port=port,
                               topology_resolved=True)


def _check_name_fits(name: str, num_nodes: int) -> None:
    """The CRD checks this where it knows numNodes; a count from a ConfigMap is checked here."""
    longest = f"{name}-{num_nodes - 1}"
    if len(longest) > MAX_HOSTNAME:
        raise SpecError(f"metadata.name is too long for {num_nodes} node(s): the pod hostname "
                        f"{longest!r} must fit in {MAX_HOSTNAME} characters; shorten the job name")


def parse_config_files(files: Mapping[str, Any] | None) -> dict[str, str]:
    """spec.accelerateConfigFiles: file names become ConfigMap keys, mounted beside the YAML."""
    parsed = {}
    for name, content in (files or {}).items():
        if not FILE_NAME.match(name) or name in (".", ".."):
            raise SpecError(
                f"spec.accelerateConfigFiles key {name!r} is not a file name (letters, digits, "
                "'-', '_' and '.'; no folders); the config refers to it by that name"
            )
        if name == CONFIG_KEY:
            raise SpecError(f"spec.accelerateConfigFiles may not hold {CONFIG_KEY!r}: that name "
                            "is the rendered accelerate YAML; rename the file (and the path in "
                            "the config)")
        if not isinstance(content, str):
            raise SpecError(f"spec.accelerateConfigFiles[{name!r}] must be the file's text")
        parsed[name] = content
    return parsed


def parse_job(body: Mapping[str, Any], status: Mapping[str, Any] | None = None) -> JobSpec:
    """`status` is the job's latest status (the reconciler's view may be newer than the body's):
    its `topology` keeps the numbers an earlier pass resolved."""
    metadata = body.get("metadata", {})
    spec = body.get("spec", {})
    template = without_nulls(spec.get("template") or {})
    if not template.get("spec", {}).get("containers"):
        raise SpecError("spec.template.spec.containers must list the trainer container")
    config_from = _config_ref(spec)
    inline = (copy.deepcopy(spec["accelerateConfig"])
              if spec.get("accelerateConfig") is not None else None)
    requested = _topology_request(spec)
    recorded = (status or {}).get("topology") or (body.get("status") or {}).get("topology")
    (nodes, procs, port), resolved = _initial_topology(requested, inline, template, recorded,
                                                       reads_configmap=config_from is not None)
    return JobSpec(
        name=metadata["name"],
        namespace=metadata.get("namespace", "default"),
        uid=metadata.get("uid", ""),
        generation=int(metadata.get("generation", 1)),
        num_nodes=nodes,
        nproc_per_node=procs,
        master_port=port,
        template=template,
        accelerate_config=inline,
        config_from=config_from,
        run_policy=_run_policy(spec.get("runPolicy") or {}),
        checkpoint=_checkpoint(spec),
        requested=requested,
        topology_resolved=resolved,
        config_files=parse_config_files(spec.get("accelerateConfigFiles")),
        code=_code(spec),
        elastic=_elastic(spec),
        queue_name=(metadata.get("labels") or {}).get(QUEUE_LABEL) or None,
    )


def without_nulls(value: Any) -> Any:
    """A copy without the keys whose value is null. The pod template keeps unknown fields, so
    the nulls that kubectl create, Helm and Python clients write for unset keys are stored; the
    API server reads them as missing, and so must every builder's default."""
    if isinstance(value, Mapping):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def _config_ref(spec: Mapping[str, Any]) -> ConfigMapKeyRef | None:
    if not spec.get("accelerateConfigFrom"):
        return None
    ref = spec["accelerateConfigFrom"].get("configMapKeyRef") or {}
    return ConfigMapKeyRef(name=ref.get("name", ""), key=ref.get("key", ""))


def _code(spec: Mapping[str, Any]) -> Code | None:
    code = spec.get("code")
    if not code:
        return None
    return Code(config_map=code["configMap"], sha256=code["sha256"],
                requirements=code.get("requirements") or None)


def _elastic(spec: Mapping[str, Any]) -> Elastic | None:
    """The CRD requires both numbers and checks their ranges; shrinkAfterSeconds has a default."""
    elastic = spec.get("elastic")
    if not elastic:
        return None
    return Elastic(min_nodes=int(elastic["minNodes"]),
                   gradient_accumulation_steps=int(elastic["gradientAccumulationSteps"]),
                   shrink_after_seconds=int(elastic.get("shrinkAfterSeconds",
                                                        DEFAULT_SHRINK_AFTER_SECONDS)))


def _checkpoint(spec: Mapping[str, Any]) -> Checkpoint | None:
    if not spec.get("checkpoint"):
        return None
    return Checkpoint(volume_name=spec["checkpoint"]["volumeName"],
                      mount_path=spec["checkpoint"].get("mountPath", "/checkpoints"))


def _topology_request(spec: Mapping[str, Any]) -> TopologyRequest:
    return TopologyRequest(
        num_nodes=int(spec["numNodes"]) if spec.get("numNodes") is not None else None,
        nproc_per_node=spec.get("numProcPerNode"),
        master_port=int(spec["masterPort"]) if spec.get("masterPort") is not None else None,
    )


def _initial_topology(
    requested: TopologyRequest,
    inline: Mapping[str, Any] | None,
    template: Mapping[str, Any],
    recorded: Mapping[str, Any] | None,
    *,
    reads_configmap: bool,
) -> tuple[tuple[int, int, int], bool]:
    """The topology as far as the body (and status.topology) tell it, and whether that is final.
    A YAML in a ConfigMap is read only when the children are made (see with_config)."""
    resolved = bool(recorded) or inline is not None or not reads_configmap or None not in (
        requested.num_nodes, requested.nproc_per_node, requested.master_port)
    try:
        return resolve_topology(requested, inline, template, recorded), resolved
    except SpecError:
        # with_config raises it again when the children are made, where it fails the job.
        return resolve_topology(requested, None, template, recorded), False


def _run_policy(policy: Mapping[str, Any]) -> RunPolicy:
    return RunPolicy(
        backoff_limit=int(policy.get("backoffLimit", 3)),
        permanent_exit_codes=tuple(policy.get("permanentExitCodes") or ()),
        active_deadline_seconds=policy.get("activeDeadlineSeconds"),
        ttl_seconds_after_finished=policy.get("ttlSecondsAfterFinished"),
        clean_pod_policy=policy.get("cleanPodPolicy", "Running"),
        suspend=bool(policy.get("suspend", False)),
        stall_timeout_seconds=policy.get("stallTimeoutSeconds"),
        node_lost_timeout_seconds=int(policy.get("nodeLostTimeoutSeconds", 10)),
        pod_disruption_budget=bool(policy.get("podDisruptionBudget", False)),
        restart_in_place=bool(policy.get("restartInPlace", True)),
        waiting_timeout_seconds=int(policy.get("waitingTimeoutSeconds", 900)),
    )
