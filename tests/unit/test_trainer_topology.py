"""parse_topology: the pod's place in the job, from the env the operator sets."""

from __future__ import annotations

import pytest
from accelerate_trainer.topology import DEFAULT_CONFIG_FILE, Topology, TopologyError, parse_topology

GOOD_ENV = {
    "MASTER_ADDR": "job-node-0.job",
    "MASTER_PORT": "29500",
    "NODE_RANK": "1",
    "NUM_NODES": "2",
    "NPROC_PER_NODE": "4",
    "WORLD_SIZE": "8",
    "ACCELERATE_CONFIG_FILE": "/etc/accelerate/job.yaml",
}


def env_with(**changes: str | None) -> dict[str, str]:
    env = dict(GOOD_ENV)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def test_complete_env_parses_to_the_whole_topology():
    assert parse_topology(GOOD_ENV) == Topology(
        master_addr="job-node-0.job",
        master_port=29500,
        node_rank=1,
        num_nodes=2,
        nproc_per_node=4,
        world_size=8,
        config_file="/etc/accelerate/job.yaml",
    )


def test_node_rank_zero_is_the_master():
    assert parse_topology(env_with(NODE_RANK="0")).is_master
    assert not parse_topology(GOOD_ENV).is_master


def test_config_file_defaults_to_the_operator_mount():
    assert parse_topology(env_with(ACCELERATE_CONFIG_FILE=None)).config_file == DEFAULT_CONFIG_FILE
    assert parse_topology(env_with(ACCELERATE_CONFIG_FILE="")).config_file == DEFAULT_CONFIG_FILE


def test_master_addr_is_stripped():
    assert parse_topology(env_with(MASTER_ADDR="  10.0.0.7 \n")).master_addr == "10.0.0.7"


def test_single_machine_single_process_is_a_valid_topology():
    topology = parse_topology(
        env_with(NODE_RANK="0", NUM_NODES="1", NPROC_PER_NODE="1", WORLD_SIZE="1")
    )
    assert (topology.num_nodes, topology.world_size, topology.is_master) == (1, 1, True)


@pytest.mark.parametrize("value", [None, "", "   "])
def test_missing_master_addr_is_rejected_because_accelerate_would_train_alone(value):
    with pytest.raises(TopologyError, match="MASTER_ADDR is not set.*trains alone"):
        parse_topology(env_with(MASTER_ADDR=value))


@pytest.mark.parametrize(
    "name", ["MASTER_PORT", "NODE_RANK", "NUM_NODES", "NPROC_PER_NODE", "WORLD_SIZE"]
)
@pytest.mark.parametrize("value", [None, ""])
def test_missing_variable_is_named_with_the_fix(name, value):
    with pytest.raises(TopologyError, match=f"^{name} is not set; .*export {name}"):
        parse_topology(env_with(**{name: value}))


@pytest.mark.parametrize(
    "name", ["MASTER_PORT", "NODE_RANK", "NUM_NODES", "NPROC_PER_NODE", "WORLD_SIZE"]
)
@pytest.mark.parametrize("value", ["two", "1.5", "0x10"])
def test_non_integer_variable_is_rejected(name, value):
    with pytest.raises(TopologyError, match=f"^{name}='{value}' is not an integer$"):
        parse_topology(env_with(**{name: value}))


@pytest.mark.parametrize("name", ["MASTER_PORT", "NUM_NODES", "NPROC_PER_NODE", "WORLD_SIZE"])
def test_zero_is_rejected_where_at_least_one_is_needed(name):
    with pytest.raises(TopologyError, match=f"^{name}=0 must be at least 1$"):
        parse_topology(env_with(**{name: "0"}))


def test_negative_node_rank_is_rejected():
    with pytest.raises(TopologyError, match="^NODE_RANK=-1 must be at least 0$"):
        parse_topology(env_with(NODE_RANK="-1"))


@pytest.mark.parametrize("port", ["65536", "100000"])
def test_master_port_above_tcp_range_is_rejected(port):
    with pytest.raises(TopologyError, match=f"MASTER_PORT={port} is not a TCP port"):
        parse_topology(env_with(MASTER_PORT=port))


def test_highest_tcp_port_is_accepted():
    assert parse_topology(env_with(MASTER_PORT="65535")).master_port == 65535


@pytest.mark.parametrize("node_rank", ["2", "3"])
def test_node_rank_must_be_below_num_nodes(node_rank):
    # accelerate itself never checks machine_rank < num_machines: the rendezvous just hangs.
    with pytest.raises(TopologyError, match=f"NODE_RANK={node_rank} must be below NUM_NODES=2"):
        parse_topology(env_with(NODE_RANK=node_rank))


@pytest.mark.parametrize("world_size", ["4", "6", "16"])
def test_world_size_must_equal_nodes_times_processes(world_size):
    with pytest.raises(
        TopologyError,
        match=rf"WORLD_SIZE={world_size} must equal NUM_NODES x NPROC_PER_NODE = 2 x 4",
    ):
        parse_topology(env_with(WORLD_SIZE=world_size))


def test_parse_does_not_read_the_process_environment(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "from-os-environ")
    assert parse_topology(GOOD_ENV).master_addr == "job-node-0.job"
    with pytest.raises(TopologyError, match="MASTER_ADDR"):
        parse_topology({})


def test_an_asked_for_gradient_accumulation_is_read_where_set():
    env = env_with(ACCELERATE_GRADIENT_ACCUMULATION_STEPS="4")
    assert parse_topology(env).gradient_accumulation == 4
    assert parse_topology(GOOD_ENV).gradient_accumulation is None


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a_bad_gradient_accumulation_is_named(value):
    with pytest.raises(TopologyError, match="ACCELERATE_GRADIENT_ACCUMULATION_STEPS"):
        parse_topology(env_with(ACCELERATE_GRADIENT_ACCUMULATION_STEPS=value))

