"""DeepSpeed ZeRO-1, ZeRO-2, ZeRO-3 and ZeRO-2 with optimizer offload, really sharded across the
two real nodes: 2 pods x 2 processes (world size 4) over gloo, the rehearsal path of
docs/deepspeed-on-cpu.md (examples/cpu-deepspeed-zero3.yaml with each DeepSpeed JSON shipped in
spec.accelerateConfigFiles, the standard launcher set by the operator).

From what the ranks print (examples/train.py's own lines): the world size and distributed_type;
what each rank holds (SHARD: about 1/4 of the optimizer state under ZeRO-1/2, about 1/4 of every
parameter under ZeRO-3), and that it is the rank's own slice of the model (the sum rank 0
computes over that slice of the gathered model, SLICES); the final loss equal to a DDP run of the
same seed, which clips at 1.0 as accelerate makes DeepSpeed do, to 1e-5. The ZeRO-3 run also
loses rank 3 once after its step-4 checkpoint: the group restarts, resumes at step 4 and
finishes with the same losses."""

from __future__ import annotations

import re
import time

import pytest

from devtools.cluster import create_namespace, delete_namespace, kubectl
from tests.helpers.deepspeed import (
    add_checkpoints,
    ddp_job,
    deepspeed_job,
    parse_setup,
    parse_shards,
    parse_slices,
    zero_config,
)
from tests.helpers.jobs import apply_job, phase_is, wait_for_job
from tests.helpers.shared_volume import SharedDir, shared_dir
from tests.helpers.training import parse_training_log

pytestmark = pytest.mark.timeout(900)

MAX_STEPS, CHECKPOINT_EVERY, FAIL_AT = 8, 4, 6
WORLD = 4
ARGS = [f"--max-steps={MAX_STEPS}", "--gradient-accumulation-steps=1", "--log-every=1"]
LOSS_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def ddp_reference(kubeconfig):
    """The same training as plain DDP (MULTI_CPU), started once and awaited by the first test
    that needs it, so it trains beside that test's job."""
    namespace = create_namespace(kubeconfig, prefix="ds-ddp-reference")
    apply_job(kubeconfig, namespace, ddp_job("ddp", ARGS))
    result: dict = {}

    def losses() -> dict[int, float]:
        if not result:
            job = wait_for_job(kubeconfig, namespace, "ddp", phase_is("Succeeded", "Failed"),
                               timeout=600, description="the DDP reference run")
            assert job["status"]["phase"] == "Succeeded", job["status"]
            log = parse_training_log(pod_log(kubeconfig, namespace, "ddp-0"))
            result.update({s.step: s.loss for s in log.steps})
        return result

    yield losses
    delete_namespace(kubeconfig, namespace)


def pod_log(kubeconfig: str, namespace: str, pod: str) -> str:
    return kubectl("-n", namespace, "logs", pod, kubeconfig=kubeconfig).stdout


CASES = {
    "zero1": (zero_config(1), "none"),
    "zero2": (zero_config(2), "none"),
    "zero2-offload": (zero_config(2, offload_optimizer=True), "cpu"),
    "zero3-resumed": (zero_config(3), "none"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_zero_shards_across_two_nodes_and_trains_as_ddp(case, kubeconfig, namespace,
                                                        ddp_reference):
    ds_config, offload = CASES[case]
    stage = ds_config["zero_optimization"]["stage"]
    body = deepspeed_job(case, ds_config, [*ARGS, "--report-shards"])
    resumed = stage == 3
    if resumed:
        body = resumable(body, shared_dir(kubeconfig, namespace))
    started = time.monotonic()
    apply_job(kubeconfig, namespace, body)
    job = wait_for_job(kubeconfig, namespace, case, phase_is("Succeeded", "Failed"),
                       timeout=600, description=f"the {case} job to finish")
    seconds = time.monotonic() - started
    assert job["status"]["phase"] == "Succeeded", job["status"]
    assert job["status"]["restarts"] == (1 if resumed else 0), job["status"]
    logs = [pod_log(kubeconfig, namespace, f"{case}-{i}") for i in range(2)]
    text = "\n".join(logs)
    if resumed:  # restarted in place: pod 0's log holds both attempts; keep the second
        logs[0] = logs[0][logs[0].rindex("restarting in place as attempt"):]

    assert_world(logs, stage, offload)
    assert_sharded(text, stage)
    steps = {s.step: s.loss for s in parse_training_log(logs[0]).steps}
    if resumed:
        assert_resumed(logs[0], steps)
    reference = ddp_reference()
    assert abs(steps[MAX_STEPS] - reference[MAX_STEPS]) <= LOSS_TOLERANCE, (steps, reference)
    for step, loss in steps.items():
        assert abs(loss - reference[step]) <= LOSS_TOLERANCE, (step, steps, reference)
    print(f"\n{case}: Succeeded in {seconds:.0f}s (apply to Succeeded), final loss "
          f"{steps[MAX_STEPS]:.6f} (DDP {reference[MAX_STEPS]:.6f})")


def resumable(body: dict, shared: SharedDir) -> dict:
    """Checkpoints every CHECKPOINT_EVERY steps on a folder both nodes mount; rank 3 dies once at
    step FAIL_AT."""
    body = add_checkpoints(body, shared.path)
    body["spec"]["runPolicy"]["backoffLimit"] = 1
    container = body["spec"]["template"]["spec"]["containers"][0]
    container["args"] += [f"--checkpoint-every={CHECKPOINT_EVERY}", f"--fail-at-step={FAIL_AT}",
                          "--fail-rank=3"]
    container["env"].append({"name": "ACCELERATE_FAIL_ONCE_MARKER",
                             "value": "/checkpoints/failed-once"})
    return body


def assert_world(logs: list[str], stage: int, offload: str) -> None:
    """Four ranks of one world, two per node, and accelerate really set up DeepSpeed."""
    ranks = {}
    for node, text in enumerate(logs):
        for info in parse_training_log(text).rank_infos:
            assert info.world_size == WORLD and info.node_rank == node, info
            ranks[info.rank] = node
    assert ranks == {0: 0, 1: 0, 2: 1, 3: 1}, ranks
    setups = parse_setup(logs[0])
    assert setups, logs[0][-3000:]
    assert {(s.distributed_type, s.zero_stage, s.offload_optimizer) for s in setups} == {
        ("DEEPSPEED", str(stage), offload)}


def assert_sharded(text: str, stage: int) -> None:
    """Each rank holds about a quarter, and it is its own slice of the model."""
    shards = {s.rank: s for s in parse_shards(text)}
    assert sorted(shards) == list(range(WORLD)), text[-3000:]
    (slices,) = parse_slices(text)
    assert slices.world == WORLD and slices.stage == stage
    for rank, shard in shards.items():
        assert shard.stage == stage
        assert shard.what == ("parameters" if stage == 3 else "optimizer")
        # ZeRO pads the flattened state to a multiple of the world size, no more.
        assert WORLD * shard.numel - shard.total < WORLD * 32, shard
        assert shard.total <= WORLD * shard.numel
        assert shard.max_fraction <= 0.26, shard  # of the model, or of each parameter (ZeRO-3)
        assert shard.adam_numel == shard.numel, shard  # Adam's state: this partition only
        assert shard.sum == pytest.approx(slices.sums[rank], rel=1e-12, abs=1e-12), (
            rank, shard, slices)
    # Four different slices: no rank holds another's, nor the whole model.
    assert len({round(s, 9) for s in slices.sums}) == WORLD, slices
    finals = {f.param_checksum for f in parse_training_log(text).finals}
    assert len(finals) == 1, finals
    assert sum(slices.sums) == pytest.approx(float(finals.pop()), abs=1e-6)


def assert_resumed(log: str, steps: dict[int, float]) -> None:
    """The second attempt resumed at the step-4 checkpoint and trained each later step once."""
    resumed = re.search(r"^RESUMED from=(\S+) step=(\d+)$", log, re.M)
    assert resumed, log[-3000:]
    assert resumed.group(1).startswith("/checkpoints/checkpoints/checkpoint_")
    assert int(resumed.group(2)) == CHECKPOINT_EVERY
    assert sorted(steps) == list(range(CHECKPOINT_EVERY + 1, MAX_STEPS + 1)), steps
