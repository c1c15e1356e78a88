"""Elastic jobs (spec.elastic): the sizes a job may run at, the gradient accumulation at each,
when its group shrinks and when it grows back, and the configs refused before any pod starts
because they cannot keep the math. Pure: free functions over explicit arguments (as JobSet's
failure_policy.go decides its policies), no clock, no API calls; the reconcile pass calls them
with what it observed and applies what they return.

The math. The global batch is numNodes x numProcPerNode x per-process batch x accumulation. The
operator changes neither the per-process batch (the script's DataLoader, or DeepSpeed's
train_micro_batch_size_per_gpu) nor the processes per node, so at n nodes the global batch stays
exactly when n x accumulation(n) = numNodes x gradientAccumulationSteps. The per-process batch
cancels out: the operator never needs to know it (it cannot: it lives in the script's arguments).
A size n is allowed when minNodes <= n <= numNodes and n divides numNodes x
gradientAccumulationSteps; a size in between that does not divide is skipped, and the message of
the resize says so. The CRD refuses a minNodes that does not divide (CEL); `check_elastic` says
it again, with the numbers, where numNodes comes from a ConfigMap the CRD cannot read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from math import gcd
from typing import Any

from accelerate_trainer.contract import ENV_GRADIENT_ACCUMULATION
from accelerate_trainer.deepspeed_checks import FILE_KEY as DEEPSPEED_FILE_KEY
from accelerate_trainer.errors import ConfigError

from .api import JobSpec, SpecError
from .constants import QUEUE_LABEL
from .timefmt import format_time

# Reasons of a resize (the Resized condition and its event, in the reconcile pass).
REASON_SHRUNK = "PodsUnschedulable"
REASON_GROWN = "CapacityReturned"
# distributed_type values that replicate the whole model and optimizer on every process (DDP on
# one kind of device or another): a checkpoint holds one copy, which loads at any world size.
REPLICATED_TYPES = frozenset({"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_NPU", "MULTI_MLU",
                              "MULTI_SDAA", "MULTI_MUSA", "MULTI_XPU", "MULTI_HPU",
                              "MULTI_NEURON"})
# torch's StateDictType values as accelerate accepts them (a name, or its number).
LOCAL_STATE_DICT = ("LOCAL_STATE_DICT", "2")


# ---- sizes and accumulation ----------------------------------------------------------------
def allowed_sizes(num_nodes: int, min_nodes: int, accumulation: int) -> tuple[int, ...]:
    """The node counts the job may run at, largest first: numNodes down to minNodes, those at
    which the accumulation stays a whole number."""
    total = num_nodes * accumulation
    return tuple(n for n in range(num_nodes, max(min_nodes, 1) - 1, -1) if total % n == 0)


def accumulation_at(num_nodes: int, accumulation: int, size: int) -> int:
    """The gradient accumulation at `size` nodes that keeps the global batch of `num_nodes` nodes
    at `accumulation`: acc_n = acc x numNodes / n. Raises ValueError where it is not whole."""
    total = num_nodes * accumulation
    if size < 1 or total % size:
        raise ValueError(f"{num_nodes} x {accumulation} micro-batches per process cannot be "
                         f"split evenly over {size} node(s)")
    return total // size


def wanted_nodes(job: JobSpec) -> int:
    """The size the job wants (its numNodes), whatever size its group runs at."""
    return job.wanted_nodes


def job_sizes(job: JobSpec) -> tuple[int, ...]:
    """`allowed_sizes` of an elastic job; only its own size for any other."""
    if job.elastic is None:
        return (job.num_nodes,)
    return allowed_sizes(wanted_nodes(job), job.elastic.min_nodes,
                         job.elastic.gradient_accumulation_steps)


def at_size(job: JobSpec, size: int) -> JobSpec:
    """The job as its group runs at `size` nodes: every builder then makes `size` pods with the
    topology of that size, and `build_elastic_env` the accumulation that keeps the global batch.
    Raises ValueError for a size the job does not allow."""
    if size not in job_sizes(job):
        raise ValueError(f"job {job.name} may run at {list(job_sizes(job))} node(s), not {size}")
    wanted = wanted_nodes(job)
    elastic = dataclasses.replace(job.elastic, wanted_nodes=None if size == wanted else wanted) \
        if job.elastic else None
    return dataclasses.replace(job, num_nodes=size, elastic=elastic)


def group_size(job: JobSpec, status: Mapping[str, Any]) -> JobSpec:
    """`job` at the size its group runs at: status.elastic.nodes, which the pass that resized
    the group wrote. As it is for a job that is not elastic or was never resized, and for a
    recorded size it does not allow (a status edited by hand)."""
    nodes = (status.get("elastic") or {}).get("nodes")
    if job.elastic is None or not isinstance(nodes, int) or nodes == job.num_nodes \
            or nodes not in job_sizes(job):
        return job
    return at_size(job, nodes)


def build_elastic_status(job: JobSpec, previous: Mapping[str, Any] | None,
                         resized_at: datetime | None = None) -> dict[str, Any]:
    """status.elastic of `job` at the size its group runs at: that size against the one it
    wants (the SIZE column), the accumulation at it, and the resizes so far (`resized_at`: this
    pass resized it)."""
    wanted, previous = wanted_nodes(job), previous or {}
    status: dict[str, Any] = {
        "nodes": job.num_nodes, "wantedNodes": wanted,
        "gradientAccumulationSteps": accumulation_at(
            wanted, job.elastic.gradient_accumulation_steps, job.num_nodes),
        "summary": f"{job.num_nodes}/{wanted}",
        "resizes": int(previous.get("resizes") or 0) + (resized_at is not None)}
    last = format_time(resized_at) if resized_at else previous.get("lastResizeTime")
    if last:
        status["lastResizeTime"] = last
    return status


def build_elastic_env(job: JobSpec) -> dict[str, str]:
    """The env the pods of an elastic job get: accelerate's own
    ACCELERATE_GRADIENT_ACCUMULATION_STEPS, at every size (at full size too, so the script's own
    value never decides a different global batch). Nothing for any other job."""
    if job.elastic is None:
        return {}
    steps = accumulation_at(wanted_nodes(job), job.elastic.gradient_accumulation_steps,
                            job.num_nodes)
    return {ENV_GRADIENT_ACCUMULATION: str(steps)}


# ---- when to shrink and when to grow -------------------------------------------------------
@dataclass(frozen=True)
class Resize:
    """Restart the group from its last complete checkpoint at `size` nodes."""

    size: int
    reason: str
    message: str


@dataclass(frozen=True)
class SizeDecision:
    """A resize to do now, or when time alone may bring one (seconds), or neither."""

    resize: Resize | None = None
    requeue_after: float | None = None


@dataclass(frozen=True)
class GroupPlacement:
    """What the scheduler did with the pods of the current group: how many are bound to a node
    that can run them (scheduled, the node not lost), since when at least one of them has been
    unschedulable without a break (None while none is), and why, in the scheduler's words, one
    line per pod."""

    placed: int
    unplaceable_since: datetime | None = None
    why: tuple[str, ...] = ()


def largest_size_that_fits(sizes: tuple[int, ...], nodes: int) -> int | None:
    """The largest allowed size of at most `nodes` nodes, or None."""
    return next((n for n in sizes if n <= nodes), None)


def decide_shrink(job: JobSpec, placement: GroupPlacement, now: datetime) -> SizeDecision:
    """`job` at the size its group runs at (`at_size`). Once pods of the group have been
    unschedulable for spec.elastic.shrinkAfterSeconds: the largest allowed size that the placed
    pods fill, when it is smaller than the group. Before then: when to look again. None below
    minNodes: the job waits as any job does (runPolicy.waitingTimeoutSeconds)."""
    if (job.elastic is None or placement.unplaceable_since is None
            or placement.placed >= job.num_nodes):
        return SizeDecision()
    waited = (now - placement.unplaceable_since).total_seconds()
    if waited < job.elastic.shrink_after_seconds:
        return SizeDecision(requeue_after=job.elastic.shrink_after_seconds - waited)
    target = largest_size_that_fits(job_sizes(job), placement.placed)
    if target is None:
        return SizeDecision()
    missing = job.num_nodes - placement.placed
    why = "".join(f"; {line}" for line in placement.why)
    message = (f"{missing} of the group's {job.num_nodes} pods could not be placed for "
               f"{waited:.0f}s (spec.elastic.shrinkAfterSeconds: "
               f"{job.elastic.shrink_after_seconds}){why}. {_restart_at(job, target)}"
               f"{_skipped(job, placement.placed, target)}")
    return SizeDecision(Resize(target, REASON_SHRUNK, message))


def decide_grow(job: JobSpec, placeholders_placed: int) -> SizeDecision:
    """`job` at the size its group runs at. The placeholders (`placeholder_indices`) hold the
    missing nodes' capacity: when the scheduler has placed some, the largest allowed size the
    group and they fill, when it is larger than the group."""
    if job.elastic is None or job.num_nodes >= wanted_nodes(job):
        return SizeDecision()
    room = job.num_nodes + min(placeholders_placed, len(placeholder_indices(job)))
    target = largest_size_that_fits(job_sizes(job), room)
    if target is None or target <= job.num_nodes:
        return SizeDecision()
    message = (f"the scheduler placed {placeholders_placed} placeholder pod(s) for the missing "
               f"nodes. {_restart_at(job, target)}")
    return SizeDecision(Resize(target, REASON_GROWN, message))


def placeholder_indices(job: JobSpec) -> tuple[int, ...]:
    """The node indices the group lacks while it runs reduced: one placeholder pod each
    (resources/placeholder.py) asks the scheduler whether their capacity is back."""
    return tuple(range(job.num_nodes, wanted_nodes(job)))


def _restart_at(job: JobSpec, size: int) -> str:
    wanted, steps = wanted_nodes(job), job.elastic.gradient_accumulation_steps
    return (f"Restarting from the last complete checkpoint at {size} of {wanted} nodes with "
            f"gradient accumulation {accumulation_at(wanted, steps, size)} "
            f"(gradientAccumulationSteps {steps} at {wanted}): the global batch stays")


def _skipped(job: JobSpec, placed: int, target: int) -> str:
    if placed <= target or placed >= job.num_nodes:
        return ""
    total = wanted_nodes(job) * job.elastic.gradient_accumulation_steps
    return (f"; {placed} nodes fit, but {placed} does not divide numNodes x "
            f"gradientAccumulationSteps = {total}")


# ---- what cannot keep the math, refused before any pod starts ------------------------------
def check_elastic(job: JobSpec, config: Mapping[str, Any],
                  deepspeed_json: Mapping[str, Any] | None = None,
                  deepspeed_source: str = "the DeepSpeed config") -> None:
    """Raises SpecError or ConfigError, naming the key and what to change, when an elastic job
    cannot run at each of its sizes with the same global batch and resume from a checkpoint
    written at another. `job` has its topology resolved; `config` is its accelerate YAML and
    `deepspeed_json` the DeepSpeed JSON it names, where it is shipped with the config."""
    if job.elastic is None:
        return
    check_sizes(job.num_nodes, job.elastic.min_nodes, job.elastic.gradient_accumulation_steps)
    check_not_queued(job.queue_name)
    check_backend(config, deepspeed_json, deepspeed_source)


def check_sizes(num_nodes: int, min_nodes: int, accumulation: int) -> None:
    """minNodes must be a size the job can run at: at most numNodes, and a divisor of numNodes x
    gradientAccumulationSteps (the CRD says so where numNodes is in the spec)."""
    if min_nodes > num_nodes:
        raise SpecError(f"spec.elastic.minNodes={min_nodes} is more than the {num_nodes} node(s) "
                        f"the job wants (numNodes); set minNodes to at most {num_nodes}")
    total = num_nodes * accumulation
    if total % min_nodes:
        working = [n for n in range(num_nodes, 0, -1) if total % n == 0]
        raise SpecError(
            f"spec.elastic.minNodes={min_nodes}: at {min_nodes} nodes the gradient accumulation "
            f"would be {num_nodes} x {accumulation} / {min_nodes} = {total / min_nodes:.2f}, not "
            f"a whole number, so the global batch could not stay. Set minNodes to one of "
            f"{', '.join(map(str, working))}, or gradientAccumulationSteps to a multiple of "
            f"{min_nodes // gcd(num_nodes, min_nodes)} (with the per-process batch lowered to "
            "keep the global batch you want)")


def check_not_queued(queue_name: str | None) -> None:
    """Kueue admits a job's Workload at one size and cannot resize it (its elastic workload
    slices serve batch Jobs only): a job may be elastic or queued, not both."""
    if queue_name:
        raise SpecError(
            f"metadata.labels[{QUEUE_LABEL}]={queue_name!r}: Kueue admits a job at one size and "
            "cannot resize its Workload yet, so a shrunk job would hold quota it does not use "
            "and a grown one quota it was never given; remove spec.elastic, or the label to "
            "run the job outside Kueue")


def check_backend(config: Mapping[str, Any], deepspeed_json: Mapping[str, Any] | None = None,
                  deepspeed_source: str = "the DeepSpeed config") -> None:
    """Only backends whose checkpoints load at another data-parallel size (docs/elastic.md)."""
    dtype = str(config.get("distributed_type", "NO"))
    if dtype == "FSDP":
        _check_fsdp_state_dict(config.get("fsdp_config") or {})
    elif dtype == "DEEPSPEED":
        _check_deepspeed(config.get("deepspeed_config") or {}, deepspeed_json, deepspeed_source)
    elif dtype not in REPLICATED_TYPES:
        raise ConfigError(
            f"distributed_type {dtype} with spec.elastic: its model layout is tied to the world "
            "size (tensor, pipeline or device-mesh parallel), so a checkpoint cannot move to "
            "another number of nodes; remove spec.elastic, or use MULTI_GPU (DDP) or FSDP")
    _check_parallelism(config.get("parallelism_config") or {})


def _check_deepspeed(block: Mapping[str, Any], ds_json: Mapping[str, Any] | None,
                     source: str) -> None:
    """DeepSpeed loads a ZeRO checkpoint at another data-parallel size only as a universal
    checkpoint: the trainer converts it and adds checkpoint.load_universal to a copy of the JSON
    (accelerate_trainer.deepspeed_universal), so there must be a JSON; and the accumulation in it
    must be "auto", or DeepSpeed's number wins over the one for the size."""
    if not block.get(DEEPSPEED_FILE_KEY):
        raise ConfigError(
            "distributed_type DEEPSPEED with spec.elastic needs deepspeed_config."
            "deepspeed_config_file (a DeepSpeed JSON): at another size the trainer loads the "
            "checkpoint as DeepSpeed's universal checkpoint, which the JSON must ask for "
            "(checkpoint.load_universal, which the trainer adds), and the YAML's own "
            "deepspeed_config keys cannot; move them into a JSON")
    steps = (ds_json or {}).get("gradient_accumulation_steps")
    if ds_json is not None and steps != "auto":
        shown = "left out (accelerate then uses 1)" if steps is None else f"{steps!r}"
        raise ConfigError(
            f"{source}: gradient_accumulation_steps is {shown}; an elastic job needs \"auto\" "
            "there, so that the accumulation for the size the group runs at "
            "(from spec.elastic.gradientAccumulationSteps) decides it")


def _check_fsdp_state_dict(block: Mapping[str, Any]) -> None:
    """FULL_STATE_DICT (one file) and SHARDED_STATE_DICT (torch distributed checkpoint, which
    reshards at load) load at any size; LOCAL_STATE_DICT files are one per rank."""
    kind = str(block.get("fsdp_state_dict_type", "")).upper()
    if kind in LOCAL_STATE_DICT:
        raise ConfigError(
            "fsdp_config.fsdp_state_dict_type LOCAL_STATE_DICT with spec.elastic: accelerate "
            "saves one file per rank (pytorch_model_fsdp_rank<r>.bin) and a group of another "
            "size cannot load them; use SHARDED_STATE_DICT (torch distributed checkpoint, "
            "resharded at load) or FULL_STATE_DICT")


def _check_parallelism(block: Mapping[str, Any]) -> None:
    """ND parallelism sizes are fixed numbers of processes: they cannot follow the world size."""
    fixed = sorted(key for key, value in block.items()
                   if key.endswith("_size") and str(value) not in ("1", "None"))
    if fixed:
        raise ConfigError(
            f"parallelism_config.{fixed[0]}={block[fixed[0]]!r} with spec.elastic: a fixed "
            "parallel size cannot follow the number of nodes; delete parallelism_config (plain "
            "FSDP shards over every process) or remove spec.elastic")
