"""The pod's place in the job, read from the env the operator sets. Pure: takes a mapping."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .contract import (
    CONFIG_FILE,
    ENV_CONFIG_FILE,
    ENV_GRADIENT_ACCUMULATION,
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ENV_NODE_RANK,
    ENV_NPROC_PER_NODE,
    ENV_NUM_NODES,
    ENV_WORLD_SIZE,
)

DEFAULT_CONFIG_FILE = CONFIG_FILE


class TopologyError(ValueError):
    """The topology env is missing or inconsistent; the message names the variable."""


@dataclass(frozen=True)
class Topology:
    """Where this pod sits: one machine (node) of a multi-node accelerate run."""

    master_addr: str
    master_port: int
    node_rank: int
    num_nodes: int
    nproc_per_node: int
    world_size: int
    config_file: str
    # The gradient accumulation the operator asks for (an elastic job's, at the size its group
    # runs at); None: the script's own.
    gradient_accumulation: int | None = None

    @property
    def is_master(self) -> bool:
        return self.node_rank == 0


def _positive_int(env: Mapping[str, str], name: str, *, minimum: int = 1) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        raise TopologyError(
            f"{name} is not set; the operator sets it on every pod (running by hand? export {name})"
        )
    try:
        value = int(raw)
    except ValueError:
        raise TopologyError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise TopologyError(f"{name}={value} must be at least {minimum}")
    return value


def parse_topology(env: Mapping[str, str]) -> Topology:
    """Read and cross-check MASTER_ADDR, MASTER_PORT, NODE_RANK, NUM_NODES, NPROC_PER_NODE and
    WORLD_SIZE, and ACCELERATE_GRADIENT_ACCUMULATION_STEPS where set. Raises TopologyError naming
    the first bad variable."""
    master_addr = env.get(ENV_MASTER_ADDR, "").strip()
    if not master_addr:
        raise TopologyError(
            f"{ENV_MASTER_ADDR} is not set; without it accelerate silently uses 127.0.0.1 and "
            "every node trains alone"
        )
    topology = Topology(
        master_addr=master_addr,
        master_port=_positive_int(env, ENV_MASTER_PORT),
        node_rank=_positive_int(env, ENV_NODE_RANK, minimum=0),
        num_nodes=_positive_int(env, ENV_NUM_NODES),
        nproc_per_node=_positive_int(env, ENV_NPROC_PER_NODE),
        world_size=_positive_int(env, ENV_WORLD_SIZE),
        config_file=env.get(ENV_CONFIG_FILE) or DEFAULT_CONFIG_FILE,
        gradient_accumulation=(_positive_int(env, ENV_GRADIENT_ACCUMULATION)
                               if env.get(ENV_GRADIENT_ACCUMULATION) else None),
    )
    if topology.master_port > 65535:
        raise TopologyError(f"MASTER_PORT={topology.master_port} is not a TCP port (1-65535)")
    if topology.node_rank >= topology.num_nodes:
        raise TopologyError(
            f"NODE_RANK={topology.node_rank} must be below NUM_NODES={topology.num_nodes}"
        )
    if topology.world_size != topology.num_nodes * topology.nproc_per_node:
        raise TopologyError(
            f"WORLD_SIZE={topology.world_size} must equal NUM_NODES x NPROC_PER_NODE = "
            f"{topology.num_nodes} x {topology.nproc_per_node}"
        )
    return topology
