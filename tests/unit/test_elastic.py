"""Elastic jobs, the pure side: the sizes a job may run at, the accumulation at each, the size
chosen for each placement situation, when it grows back, every refusal, and what the pods of a
reduced group are told."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest
from accelerate_operator.api import Elastic, SpecError, parse_job
from accelerate_operator.elastic import (
    REASON_GROWN,
    REASON_SHRUNK,
    GroupPlacement,
    Resize,
    SizeDecision,
    accumulation_at,
    allowed_sizes,
    at_size,
    build_elastic_env,
    check_backend,
    check_elastic,
    check_sizes,
    decide_grow,
    decide_shrink,
    job_sizes,
    placeholder_indices,
    wanted_nodes,
)
from accelerate_operator.resources.configmap import prepare_config
from accelerate_operator.resources.pods import build_pod
from accelerate_trainer.config import ConfigError

from tests.helpers.jobs import JobBuilder


def elastic_job(nodes: int = 2, min_nodes: int = 1, accumulation: int = 2, **fields):
    return parse_job(JobBuilder().nodes(nodes).elastic(min_nodes, accumulation, **fields).build())


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}


# ---- sizes and accumulation ----------------------------------------------------------------
@pytest.mark.parametrize(("nodes", "min_nodes", "accumulation", "sizes"), [
    (2, 1, 1, (2, 1)),
    (4, 1, 1, (4, 2, 1)),        # 3 is skipped: 4 micro-batches do not split over 3 nodes
    (4, 2, 3, (4, 3, 2)),        # with 12 they do
    (8, 4, 1, (8, 4)),           # 5, 6 and 7 skipped
    (3, 1, 2, (3, 2, 1)),
    (4, 4, 1, (4,)),             # minNodes = numNodes: never shrinks
])
def test_allowed_sizes_are_those_that_keep_the_accumulation_whole(nodes, min_nodes,
                                                                  accumulation, sizes):
    assert allowed_sizes(nodes, min_nodes, accumulation) == sizes
    for size in sizes:  # and at each the global batch (in micro-batches per process) stays
        assert size * accumulation_at(nodes, accumulation, size) == nodes * accumulation


@pytest.mark.parametrize(("nodes", "accumulation", "size", "expected"), [
    (2, 2, 2, 2), (2, 2, 1, 4), (4, 1, 2, 2), (4, 3, 3, 4), (8, 1, 4, 2)])
def test_accumulation_at_a_size_is_accumulation_times_wanted_over_size(nodes, accumulation,
                                                                       size, expected):
    assert accumulation_at(nodes, accumulation, size) == expected


@pytest.mark.parametrize("size", [3, 0, 5])
def test_an_accumulation_that_is_not_whole_is_an_error(size):
    with pytest.raises(ValueError, match="cannot be split evenly"):
        accumulation_at(4, 1, size)


def test_spec_elastic_is_parsed_with_its_default_wait():
    job = elastic_job(4, 2, 3)
    assert job.elastic == Elastic(min_nodes=2, gradient_accumulation_steps=3,
                                  shrink_after_seconds=120)
    assert elastic_job(shrinkAfterSeconds=30).elastic.shrink_after_seconds == 30
    assert parse_job(JobBuilder().build()).elastic is None


def test_a_job_at_a_reduced_size_keeps_the_size_it_wants_and_comes_back_whole():
    job = elastic_job(4, 1, 1)
    reduced = at_size(job, 2)
    assert (reduced.num_nodes, reduced.world_size, wanted_nodes(reduced)) == (2, 4, 4)
    assert job_sizes(reduced) == (4, 2, 1)
    assert at_size(reduced, 4) == job
    with pytest.raises(ValueError, match=r"may run at \[4, 2, 1\] node\(s\), not 3"):
        at_size(job, 3)


def test_the_pods_of_a_reduced_group_get_its_topology_and_the_raised_accumulation():
    job = elastic_job(2, 1, 2)
    full = env_of(build_pod(job, 1, attempt=0))
    assert (full["NUM_NODES"], full["WORLD_SIZE"]) == ("2", "4")
    assert full["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "2"  # at full size too
    reduced = env_of(build_pod(at_size(job, 1), 0, attempt=1))
    assert (reduced["NUM_NODES"], reduced["WORLD_SIZE"]) == ("1", "2")
    assert reduced["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"


def test_a_job_that_is_not_elastic_gets_no_accumulation_env():
    job = parse_job(JobBuilder().build())
    assert build_elastic_env(job) == {}
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" not in env_of(build_pod(job, 0, attempt=0))


# ---- when to shrink ------------------------------------------------------------------------
NOW = datetime(2026, 1, 1, 12, 0, 0)


def shrink(job, placed, unplaceable_for=None, why=()):
    since = None if unplaceable_for is None else NOW - timedelta(seconds=unplaceable_for)
    return decide_shrink(job, GroupPlacement(placed, since, why), NOW)


def test_a_group_whose_pods_are_all_placed_keeps_its_size():
    assert shrink(elastic_job(), placed=2) == SizeDecision()
    # A placed count that has caught up with an older unschedulable time: nothing to shrink.
    assert shrink(elastic_job(), placed=2, unplaceable_for=600) == SizeDecision()


def test_before_the_wait_is_over_the_pass_is_told_when_to_look_again():
    assert shrink(elastic_job(), placed=1, unplaceable_for=50) == SizeDecision(requeue_after=70)


def test_after_the_wait_the_group_shrinks_to_the_placed_pods_saying_why_they_were_not():
    decision = shrink(elastic_job(2, 1, 2), placed=1, unplaceable_for=120,
                      why=("pod train-1 cannot be scheduled: Unschedulable: 0/2 nodes are "
                           "available: 1 Insufficient cpu",))
    assert decision.requeue_after is None
    assert decision.resize == Resize(1, REASON_SHRUNK, (
        "1 of the group's 2 pods could not be placed for 120s (spec.elastic.shrinkAfterSeconds: "
        "120); pod train-1 cannot be scheduled: Unschedulable: 0/2 nodes are available: 1 "
        "Insufficient cpu. Restarting from the last complete checkpoint at 1 of 2 nodes with "
        "gradient accumulation 4 (gradientAccumulationSteps 2 at 2): the global batch stays"))


def test_a_size_that_does_not_divide_is_skipped_and_the_message_says_why():
    decision = shrink(elastic_job(4, 1, 1), placed=3, unplaceable_for=600)
    assert decision.resize.size == 2
    assert decision.resize.message.endswith(
        "; 3 nodes fit, but 3 does not divide numNodes x gradientAccumulationSteps = 4")


def test_a_reduced_group_that_loses_more_shrinks_again():
    reduced = at_size(elastic_job(4, 1, 1), 2)
    decision = shrink(reduced, placed=1, unplaceable_for=600)
    assert decision.resize.size == 1
    assert "at 1 of 4 nodes with gradient accumulation 4" in decision.resize.message


def test_below_min_nodes_the_group_waits_as_any_job_does():
    assert shrink(elastic_job(4, 2, 1), placed=1, unplaceable_for=600) == SizeDecision()
    assert shrink(elastic_job(2, 1, 1), placed=0, unplaceable_for=600) == SizeDecision()


def test_a_job_that_is_not_elastic_never_shrinks():
    assert shrink(parse_job(JobBuilder().build()), placed=1, unplaceable_for=10**6) == \
        SizeDecision()


def test_the_wait_is_the_jobs_own():
    job = elastic_job(shrinkAfterSeconds=0)
    assert shrink(job, placed=1, unplaceable_for=0).resize.size == 1


# ---- when to grow back ---------------------------------------------------------------------
def test_a_reduced_group_holds_a_placeholder_for_each_missing_node():
    assert placeholder_indices(at_size(elastic_job(4, 1, 1), 1)) == (1, 2, 3)
    assert placeholder_indices(elastic_job(4, 1, 1)) == ()


def test_it_grows_back_once_the_scheduler_places_the_missing_nodes():
    reduced = at_size(elastic_job(2, 1, 2), 1)
    assert decide_grow(reduced, placeholders_placed=0) == SizeDecision()
    decision = decide_grow(reduced, placeholders_placed=1)
    assert decision.resize == Resize(2, REASON_GROWN, (
        "the scheduler placed 1 placeholder pod(s) for the missing nodes. Restarting from the "
        "last complete checkpoint at 2 of 2 nodes with gradient accumulation 2 "
        "(gradientAccumulationSteps 2 at 2): the global batch stays"))


def test_it_grows_to_the_largest_allowed_size_the_placeholders_make_room_for():
    reduced = at_size(elastic_job(4, 1, 1), 1)
    assert decide_grow(reduced, 1).resize.size == 2
    assert decide_grow(reduced, 2).resize.size == 2  # 3 does not divide 4
    assert decide_grow(reduced, 3).resize.size == 4
    assert decide_grow(at_size(elastic_job(4, 1, 1), 2), 1) == SizeDecision()


def test_a_group_at_full_size_never_grows():
    assert decide_grow(elastic_job(), placeholders_placed=5) == SizeDecision()


# ---- refusals ------------------------------------------------------------------------------
def test_min_nodes_above_num_nodes_is_refused_naming_both():
    with pytest.raises(SpecError, match=r"minNodes=3 is more than the 2 node\(s\) the job wants"):
        check_sizes(2, 3, 1)


def test_a_min_nodes_that_does_not_divide_is_refused_with_the_sizes_that_do():
    with pytest.raises(SpecError) as error:
        check_sizes(4, 3, 1)
    assert str(error.value) == (
        "spec.elastic.minNodes=3: at 3 nodes the gradient accumulation would be 4 x 1 / 3 = "
        "1.33, not a whole number, so the global batch could not stay. Set minNodes to one of "
        "4, 2, 1, or gradientAccumulationSteps to a multiple of 3 (with the per-process batch "
        "lowered to keep the global batch you want)")
    check_sizes(4, 3, 3)  # 12 micro-batches split over 3


def test_an_elastic_job_queued_by_kueue_is_refused_naming_the_label():
    job = parse_job(JobBuilder().elastic(1, 1).queue("team-a").build())
    with pytest.raises(SpecError, match=r"metadata.labels\[kueue.x-k8s.io/queue-name\]="
                                        r"'team-a': Kueue admits a job at one size"):
        check_elastic(job, {"distributed_type": "MULTI_CPU"})


@pytest.mark.parametrize(("config", "match"), [
    ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2}},
     "DEEPSPEED with spec.elastic needs deepspeed_config.deepspeed_config_file"),
    ({"distributed_type": "MEGATRON_LM"}, "distributed_type MEGATRON_LM with spec.elastic"),
    ({"distributed_type": "XLA"}, "distributed_type XLA with spec.elastic"),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_state_dict_type": "LOCAL_STATE_DICT"}},
     "LOCAL_STATE_DICT with spec.elastic: accelerate saves one file per rank"),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_state_dict_type": 2}},
     "LOCAL_STATE_DICT"),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2},
      "parallelism_config": {"parallelism_config_tp_size": 2}},
     "parallelism_config.parallelism_config_tp_size=2 with spec.elastic"),
])
def test_backends_whose_checkpoints_cannot_change_size_are_refused(config, match):
    with pytest.raises(ConfigError, match=match):
        check_backend(config)


@pytest.mark.parametrize("config", [
    {"distributed_type": "MULTI_CPU", "use_cpu": True},
    {"distributed_type": "MULTI_GPU"},
    {"distributed_type": "FSDP"},
    {"distributed_type": "FSDP", "fsdp_config": {"fsdp_state_dict_type": "SHARDED_STATE_DICT"}},
    {"distributed_type": "FSDP", "fsdp_config": {"fsdp_state_dict_type": "FULL_STATE_DICT"}},
    {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2},
     "parallelism_config": {"parallelism_config_dp_shard_size": 1}},
])
def test_backends_whose_checkpoints_load_at_any_size_pass(config):
    check_backend(config)


DS_CONFIG = {"distributed_type": "DEEPSPEED",
             "deepspeed_config": {"deepspeed_config_file": "ds.json"}}


@pytest.mark.parametrize(("steps", "shown"), [(2, "2"), (None, "left out")])
def test_a_deepspeed_json_whose_accumulation_would_win_is_refused(steps, shown):
    ds_json = {"zero_optimization": {"stage": 3}}
    if steps is not None:
        ds_json["gradient_accumulation_steps"] = steps
    with pytest.raises(ConfigError,
                       match=f"gradient_accumulation_steps is {shown}.*needs \"auto\""):
        check_backend(DS_CONFIG, ds_json)


def test_deepspeed_with_a_json_that_leaves_the_accumulation_to_the_size_passes():
    check_backend(DS_CONFIG, {"gradient_accumulation_steps": "auto",
                              "zero_optimization": {"stage": 3}})
    check_backend(DS_CONFIG, None)  # a JSON in a pod volume: the trainer checks it there


def test_the_shipped_deepspeed_json_is_checked_when_the_job_is_rendered():
    body = (JobBuilder().elastic(1, 2).config(**DS_CONFIG)
            .spec(accelerateConfigFiles={"ds.json": json.dumps({
                "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 2,
                "zero_optimization": {"stage": 2}})}).build())
    with pytest.raises(ConfigError, match=r"deepspeed_config_file 'ds.json': "
                                          r"gradient_accumulation_steps is 2; an elastic job"):
        prepare_config(parse_job(body), None)


def test_the_refusal_fails_the_job_before_any_pod_and_a_good_job_renders_without_a_size():
    """prepare_config is where the operator fails a job whose config cannot run."""
    refused = parse_job(JobBuilder().elastic(1, 1)
                        .config(distributed_type="MEGATRON_LM").build())
    with pytest.raises(ConfigError, match="MEGATRON_LM with spec.elastic"):
        prepare_config(refused, None)
    job, configmap = prepare_config(elastic_job(2, 1, 2), None)
    rendered = configmap["data"]["config.yaml"]
    # The trainer passes the size its group runs at on the command line; the YAML says none.
    assert "num_machines" not in rendered and "num_processes" not in rendered
    assert "main_process_port: 29500" in rendered
    assert "num_machines: 2" in prepare_config(parse_job(JobBuilder().build()), None)[1][
        "data"]["config.yaml"]
