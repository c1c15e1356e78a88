"""The rendezvous, ND-parallelism and block keys accelerate 1.10-1.15 accepts: each works across
pods or is refused naming the key (issue 48). Refusals of the spec alone come from the operator's
render, before any pod; block keys from the trainer, against the installed accelerate's own
launch arguments."""

from __future__ import annotations

import pytest
from accelerate_operator.api import parse_job
from accelerate_operator.resources.configmap import prepare_config
from accelerate_trainer.command import build_launch_plan
from accelerate_trainer.config import ConfigError, check_against_accelerate_schema
from accelerate_trainer.rendezvous import rendezvous_timeout
from accelerate_trainer.schema import from_accelerate
from accelerate_trainer.topology import Topology

from tests.helpers.jobs import JobBuilder

CPU = {"distributed_type": "MULTI_CPU", "use_cpu": True}
FSDP2 = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}


def refused(nodes: int = 2, **config) -> str:
    with pytest.raises(ConfigError) as error:
        prepare_config(parse_job(JobBuilder("j").nodes(nodes).procs(2).config(**config).build()),
                       None)
    return str(error.value)


def renders(nodes: int = 2, **config) -> None:
    prepare_config(parse_job(JobBuilder("j").nodes(nodes).procs(2).config(**config).build()), None)


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2", "my-store"])
def test_a_rendezvous_backend_no_pod_serves_is_refused_naming_the_key(backend):
    message = refused(**CPU, rdzv_backend=backend)
    assert message.startswith(f"rdzv_backend {backend!r}") and "static" in message


def test_c10d_with_same_network_across_pods_is_refused_naming_same_network():
    message = refused(**CPU, rdzv_backend="c10d", same_network=True)
    assert message.startswith("same_network: true with rdzv_backend: c10d")
    assert "localhost:29400" in message


@pytest.mark.parametrize("config", [
    {"rdzv_backend": "c10d", "same_network": False},  # c10d meets at pod 0's main port
    {"rdzv_backend": "static", "same_network": True},  # static meets at master_addr
    {"rdzv_backend": "c10d", "same_network": True, "nodes": 1},  # one pod: its own localhost
])
def test_the_rendezvous_settings_that_work_across_pods_render(config):
    renders(**{**CPU, **config})


def test_parallelism_config_on_a_cpu_job_is_refused_naming_the_key():
    message = refused(**CPU, parallelism_config={"parallelism_config_dp_shard_size": 2})
    assert message.startswith("parallelism_config is set, but this is a CPU job")
    assert "plain DDP" in message


def test_parallelism_config_outside_fsdp2_is_refused_before_accelerate_would_in_every_rank():
    block = {"parallelism_config": {"parallelism_config_tp_size": 2}}
    assert "fsdp_version 1" in refused(distributed_type="FSDP", **block)
    assert "here MULTI_GPU" in refused(distributed_type="MULTI_GPU", **block)
    renders(**FSDP2, **block)


@pytest.fixture(scope="module")
def schema():
    return from_accelerate()


@pytest.mark.parametrize(("block", "bad", "hint"), [
    ("parallelism_config", {"dp_shard_size": 2}, "did you mean parallelism_config_dp_shard_size"),
    ("dynamo_config", {"dynamo_backend": "INDUCTOR", "modee": "max-autotune"},
     "did you mean dynamo_mode"),
    ("fsdp_config", {"fsdp_version": 2, "fsdp_reshard_after_forwrd": True},
     "did you mean fsdp_reshard_after_forward"),
])
def test_a_block_key_accelerate_has_no_launch_argument_for_is_refused(schema, block, bad, hint):
    config = {**FSDP2, block: {**FSDP2.get(block, {}), **bad}}
    with pytest.raises(ConfigError) as error:
        check_against_accelerate_schema(config, schema)
    assert str(error.value).startswith(f"{block} key(s) ") and hint in str(error.value)


def test_the_keys_accelerate_config_writes_are_all_launch_arguments(schema):
    config = {**FSDP2, "dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_mode": "default",
                                         "dynamo_use_fullgraph": False},
              "parallelism_config": {"parallelism_config_dp_shard_size": 2,
                                     "parallelism_config_tp_size": 2}}
    check_against_accelerate_schema(config, schema)


def test_the_rendezvous_timeout_comes_from_the_env_and_reaches_torchrun():
    assert rendezvous_timeout({}) == 600
    assert rendezvous_timeout({"ACCELERATE_TRAINER_RENDEZVOUS_TIMEOUT": "45"}) == 45
    for bad in ("ten", "0", "-5", "1.5"):
        with pytest.raises(ConfigError, match="ACCELERATE_TRAINER_RENDEZVOUS_TIMEOUT"):
            rendezvous_timeout({"ACCELERATE_TRAINER_RENDEZVOUS_TIMEOUT": bad})
    topology = Topology("j-0.j", 29500, 1, 2, 2, 4, "/etc/accelerate/config.yaml")
    argv = build_launch_plan(topology, CPU, ["train.py"], rendezvous_timeout=45).argv
    assert argv[argv.index("--rdzv_conf") + 1] == "timeout=45,join_timeout=45"
