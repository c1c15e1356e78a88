"""End to end, on the CPU nodes: every entry of docs/ignored-config-values.md a CPU pod can show.
A value whose loss would change the training fails the job (InvalidConfig, no restart): before
any pod when the spec decides it, in the pod with exit 78 when only the pod's hardware does (the
CPU trainer image has no C++ compiler, so inductor is refused there). A harmless one trains to
Succeeded, with a Warning event (IgnoredConfigValues) and the ConfigWarnings condition naming the
key, and, where the pod still reads the key, a WARNING line in the pod's log. bf16 on CPU and the
defaults `accelerate config` writes train as written, with no warning.

Every job is applied at once and checked as each finishes (as the corpus test does): the refused
ones stop within seconds, the others train 2 steps on 1 pod x 2 processes. The harmless values
share jobs (Case.job: their configs merged, each warning being its own check of the config), so
that three pods train where ten did; each value is still checked in its job's condition, event
and log."""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest

from devtools.cluster import kubectl
from devtools.images import TRAINER_CPU_IMAGE
from tests.helpers.jobs import JobBuilder, wait_until_finished
from tests.helpers.training import IMAGE_TRAIN_SCRIPT

pytestmark = pytest.mark.timeout(900)

IMAGE = TRAINER_CPU_IMAGE
CPU = {"distributed_type": "MULTI_CPU", "use_cpu": True}


class Case(NamedTuple):
    config: dict
    refused: str | None = None  # a substring of the Failed condition's message
    before_pods: bool = True  # refused by the operator (no pod ever exists)
    warned: str | None = None  # a substring of the Warning event and the condition
    logged: bool = False  # the trainer also prints the warning (the key reaches the pod)
    resources: dict | None = None
    procs: int = 2
    job: str | None = None  # the job it shares with other harmless values (else its own)


CASES = {
    # ---- refused: the spec decides, before any pod
    "r1-fsdp-block": Case({**CPU, "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD"}},
                          "accelerate reads fsdp_config only when distributed_type is FSDP"),
    "r2-deepspeed-block": Case({**CPU, "deepspeed_config": {"zero_stage": 2}},
                               "accelerate reads deepspeed_config only when distributed_type is "
                               "DEEPSPEED"),
    "r3-megatron-block": Case({**CPU, "megatron_lm_config": {"megatron_lm_tp_degree": 2}},
                              "accelerate reads megatron_lm_config only when distributed_type is "
                              "MEGATRON_LM"),
    "r4-fp16-on-cpu": Case({**CPU, "mixed_precision": "fp16"},
                           "mixed_precision: fp16 on a CPU job"),
    "r5-fp8-on-cpu": Case({**CPU, "mixed_precision": "fp8"},
                          "mixed_precision fp8 needs GPUs with FP8 support"),
    # A GPU job is refused before any pod, so even a CPU cluster shows it.
    "r6-gpu-ids-beyond-limit": Case({"distributed_type": "MULTI_GPU", "gpu_ids": "0,3"},
                                    "gpu_ids '0,3' names GPU(s) 3 but each pod has 2 GPU(s)",
                                    resources={"limits": {"nvidia.com/gpu": 2}}),
    "r7-gpu-ids-too-few": Case({"distributed_type": "MULTI_GPU", "gpu_ids": "0"},
                               "makes 1 GPU(s) visible but each pod runs 2 process(es)",
                               resources={"limits": {"nvidia.com/gpu": 2}}),
    # accelerate 1.10+ keys (issue 48)
    "r11-parallelism-on-cpu": Case({**CPU, "parallelism_config": {
        "parallelism_config_dp_shard_size": 2}},
        "parallelism_config is set, but this is a CPU job"),
    "r12-etcd-rendezvous": Case({**CPU, "rdzv_backend": "etcd"}, "rdzv_backend 'etcd'"),
    # ---- refused: the pod decides (exit 78 before launch)
    "r13-dropped-dynamo-key": Case({**CPU, "dynamo_config": {"dynamo_backend": "NO",
                                                             "modee": "default"}},
                                   "dynamo_config key(s) modee (did you mean dynamo_mode?)",
                                   before_pods=False),
    "r9-inductor-no-compiler": Case({**CPU, "dynamo_config": {"dynamo_backend": "INDUCTOR"}},
                                    "dynamo_config.dynamo_backend INDUCTOR compiles C++ for the "
                                    "CPU, but this image has no C++ compiler", before_pods=False),
    "r10-fp16-no-gpu": Case({"distributed_type": "NO", "mixed_precision": "fp16"},
                            "mixed_precision: fp16 on a pod whose torch sees no GPU",
                            before_pods=False, procs=1),
    # ---- warned: trains
    "w1-gpu-ids-on-cpu": Case({**CPU, "gpu_ids": "0"}, warned="gpu_ids '0' is ignored",
                              job="warned-a"),
    "w2-downcast-bf16": Case({**CPU, "mixed_precision": "bf16", "downcast_bf16": "yes"},
                             warned="downcast_bf16 'yes' is ignored", logged=True, job="warned-a"),
    "w3-fp8-config": Case({**CPU, "fp8_config": {"backend": "TE"}},
                          warned="fp8_config is ignored", logged=True, job="warned-a"),
    "w4-cpu-affinity": Case({**CPU, "enable_cpu_affinity": True},
                            warned="enable_cpu_affinity is ignored on a CPU job", logged=True,
                            job="warned-a"),
    "w5-mpirun-config": Case({**CPU, "mpirun_config": {"mpirun_hostfile": "/hosts"}},
                             warned="mpirun_config ({'mpirun_hostfile': '/hosts'}) is ignored",
                             logged=True, job="warned-b"),
    "w6-tpu-keys": Case({**CPU, "tpu_name": "my-tpu", "tpu_zone": "us-central1-a"},
                        warned="tpu_name, tpu_zone are ignored", logged=True, job="warned-b"),
    "w7-main-function": Case({**CPU, "main_training_function": "train"},
                             warned="main_training_function 'train' is ignored", logged=True,
                             job="warned-b"),
    "w8-main-process-ip": Case({**CPU, "main_process_ip": "10.0.0.1"},
                               warned="main_process_ip '10.0.0.1' is replaced", job="warned-b"),
    # ---- trained as written
    "ok-bf16-on-cpu": Case({**CPU, "mixed_precision": "bf16"}, job="as-written"),
    "ok-defaults": Case({**CPU, "downcast_bf16": "no", "gpu_ids": "all", "tpu_env": [],
                         "tpu_use_cluster": False, "main_training_function": "main",
                         "enable_cpu_affinity": False, "fsdp_config": {},
                         "deepspeed_config": {}, "rdzv_backend": "static",
                         "same_network": True}, job="as-written"),
}


def job(name: str, case: Case) -> dict:
    return (JobBuilder(name).for_server().nodes(1).procs(case.procs).config(**case.config)
            .unset("masterPort").run_policy(backoffLimit=0, cleanPodPolicy="None").grace(1)
            .image(IMAGE).args(str(IMAGE_TRAIN_SCRIPT), "--max-steps=2", "--log-every=1")
            .env(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
            .container(resources=case.resources
                       or {"requests": {"cpu": "10m", "memory": "64Mi"}})
            .build())


def job_of(name: str) -> str:
    return CASES[name].job or name


def jobs() -> dict[str, dict]:
    """A job per case, or per Case.job for the values that share one: their configs merged."""
    merged: dict[str, Case] = {}
    for name, case in CASES.items():
        first = merged.get(job_of(name), case)
        merged[job_of(name)] = first._replace(config={**first.config, **case.config})
    return {name: job(name, case) for name, case in merged.items()}


def condition(status: dict, type_: str) -> dict:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), {})


def test_every_dropped_value_a_cpu_pod_can_show_is_refused_or_warned(kubeconfig: str,
                                                                    namespace: str):
    bodies = jobs()
    kubectl("-n", namespace, "apply", "-f", "-", kubeconfig=kubeconfig,
            input=json.dumps({"apiVersion": "v1", "kind": "List",
                              "items": list(bodies.values())}))

    statuses = wait_until_finished(kubeconfig, namespace, list(bodies), timeout=840)
    events = json.loads(kubectl("-n", namespace, "get", "events", "-o", "json",
                                kubeconfig=kubeconfig).stdout)["items"]
    problems = []
    for name, case in CASES.items():
        status = statuses[job_of(name)]
        failed = condition(status, "Failed")
        pods = kubectl("-n", namespace, "get", "pods", "-l",
                       f"accelerate-operator.io/job-name={job_of(name)}", "-o", "name",
                       kubeconfig=kubeconfig).stdout.split()
        if case.refused:
            if status.get("phase") != "Failed" or case.refused not in failed.get("message", ""):
                problems.append(f"{name}: expected Failed naming {case.refused!r}, got "
                                f"{status.get('phase')}: {failed.get('message')}")
            elif failed.get("reason") != "InvalidConfig" or status.get("restarts"):
                problems.append(f"{name}: expected InvalidConfig without restarts: {status}")
            if case.before_pods and pods:
                problems.append(f"{name}: refused before any pod, yet pods exist: {pods}")
            if not case.before_pods and "exit code 78" not in failed.get("message", ""):
                problems.append(f"{name}: expected the pod's exit 78: {failed.get('message')}")
            continue
        if status.get("phase") != "Succeeded":
            problems.append(f"{name}: expected Succeeded, got {status.get('phase')}: "
                            f"{failed.get('message')}")
            continue
        warnings = condition(status, "ConfigWarnings")
        warned = [e for e in events if e["involvedObject"]["name"] == job_of(name)
                  and e["reason"] == "IgnoredConfigValues"]
        if case.warned is None:
            if warnings or warned:
                problems.append(f"{name}: trained as written, yet warned: {warnings}")
            continue
        if case.warned not in warnings.get("message", ""):
            problems.append(f"{name}: ConfigWarnings condition lacks {case.warned!r}: {warnings}")
        if not any(e["type"] == "Warning" and case.warned in e["message"] for e in warned):
            problems.append(f"{name}: no Warning event names {case.warned!r}")
        if case.logged:
            log = kubectl("-n", namespace, "logs", f"{job_of(name)}-0",
                          kubeconfig=kubeconfig).stdout
            if "WARNING: accelerate config: " + case.warned not in log:
                problems.append(f"{name}: the pod's log does not warn {case.warned!r}")
    assert not problems, "\n".join(problems)
