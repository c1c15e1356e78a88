"""Every example in examples/ is rendered by the operator's builders and passes the trainer's own
validation (accelerate's config schema plus our topology checks), as each of its pods would."""

from __future__ import annotations

from pathlib import Path

import pytest
from accelerate_operator.api import parse_job
from accelerate_operator.resources.configmap import build_configmap, render_accelerate_config
from accelerate_operator.resources.pods import build_pod
from accelerate_trainer.__main__ import validate
from accelerate_trainer.command import build_launch_plan
from accelerate_trainer.config import parse_accelerate_yaml
from accelerate_trainer.deepspeed_cpu import deepspeed_on_cpu_requested
from accelerate_trainer.topology import parse_topology

from devtools.examples import EXAMPLES_DIR, load_example, user_config

EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))
load = load_example


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_renders_and_passes_the_trainers_validation_on_every_node(path: Path):
    body, configmaps = load(path)
    job = parse_job(body)
    rendered = render_accelerate_config(job, user_config(body, configmaps), job.config_files)
    config_text = build_configmap(job, rendered)["data"]["config.yaml"]
    config = parse_accelerate_yaml(config_text)
    for index in range(job.num_nodes):
        pod = build_pod(job, index, attempt=0)
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
        topology = parse_topology(env)
        # A CPU example's pods see no GPU (the DeepSpeed rehearsal's included); a GPU one's do.
        rehearsal = deepspeed_on_cpu_requested(env)
        gpus = None if config.get("use_cpu") else 0 if rehearsal else job.nproc_per_node
        validate(topology, config, visible_gpus=gpus, deepspeed_on_cpu=rehearsal)
        plan = build_launch_plan(topology, config, pod["spec"]["containers"][0]["args"])
        assert plan.argv[plan.argv.index("--machine_rank") + 1] == str(index)
        assert plan.argv[plan.argv.index("--num_processes") + 1] == str(job.world_size)


def test_cpu_example_is_really_distributed_on_cpu():
    body, _ = load(next(p for p in EXAMPLES if p.name == "cpu-ddp.yaml"))
    job = parse_job(body)
    config = render_accelerate_config(job, body["spec"]["accelerateConfig"])
    env = {e["name"]: e["value"] for e in build_pod(job, 1, 0)["spec"]["containers"][0]["env"]}
    plan = build_launch_plan(parse_topology(env), config, ["train.py"])
    assert "--multi_gpu" in plan.argv
    assert plan.env["ACCELERATE_USE_CPU"] == "1"
    assert job.world_size == 4
