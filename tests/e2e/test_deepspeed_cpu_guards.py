"""End to end, on the CPU nodes: what keeps DeepSpeed (and FSDP) on pods without GPUs from
training something else in silence, and the trainer image that runs DeepSpeed there.

- a DEEPSPEED config without the opt-in fails before launch (exit 78), naming the fix;
- DEEPSPEED or FSDP with use_cpu is refused before any pod (it would train plain DDP);
- an FSDP config on CPU pods fails before launch (accelerate would run it as NO or MULTI_CPU);
- an opted-in script that leaves out the gloo backend fails in its ranks instead of training
  each rank alone;
- the image has no C++ compiler, and DeepSpeed's CPU ops load from the installed package.
The refused jobs stop within seconds; all, and the image probe, are applied at once when the
module starts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devtools.cluster import create_namespace, delete_namespace, kubectl
from tests.helpers.deepspeed import deepspeed_job, zero_config
from tests.helpers.jobs import JobBuilder, apply_jobs, command_job, condition, wait_until_finished
from tests.helpers.training import IMAGE_TRAIN_SCRIPT

pytestmark = pytest.mark.timeout(600)

# A script that builds its Accelerator as most scripts do, without the gloo backend, and then
# checks what the trainer launched.
ALONE = """\
from accelerate import Accelerator
from accelerate_trainer.deepspeed_cpu import check_accelerator

check_accelerator(Accelerator())
print("NOT REACHED")
"""
# What the trainer image holds: prints our own lines (COMPILER, OP, JIT_DIR).
IMAGE_PROBE = """\
import os, shutil
os.environ["TORCH_EXTENSIONS_DIR"] = "/tmp/torch-extensions"
from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder
for name in ("g++", "c++", "gcc", "cc", "clang"):
    print("COMPILER", name, shutil.which(name))
for builder in (CPUAdamBuilder(), ShareMemCommBuilder()):
    print("OP", builder.name, builder.load().__file__)
print("JIT_DIR", os.path.exists("/tmp/torch-extensions"))
"""
FSDP = {"distributed_type": "FSDP",
        "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": True}}


def one_pod(body: dict) -> dict:
    body["spec"].update(numNodes=1, numProcPerNode=2)
    body["spec"]["runPolicy"] = {"backoffLimit": 0, "cleanPodPolicy": "None"}
    return body


def deepspeed(name: str, *, opt_in: bool = True, use_cpu: bool = False) -> dict:
    body = one_pod(deepspeed_job(name, zero_config(2), ["--max-steps=2"]))
    container = body["spec"]["template"]["spec"]["containers"][0]
    if not opt_in:
        container["env"] = [e for e in container["env"]
                            if e["name"] != "ACCELERATE_TRAINER_DEEPSPEED_ON_CPU"]
    if use_cpu:
        body["spec"]["accelerateConfig"]["use_cpu"] = True
    return body


def without_gloo(name: str) -> dict:
    body = deepspeed(name)
    body["spec"]["accelerateConfigFiles"]["alone.py"] = ALONE
    body["spec"]["template"]["spec"]["containers"][0]["args"] = ["/etc/accelerate/alone.py"]
    return body


def fsdp(name: str, **extra) -> dict:
    return (JobBuilder(name).nodes(1).procs(2).config(**FSDP, **extra)
            .run_policy(backoffLimit=0, cleanPodPolicy="None")
            .container(args=[str(IMAGE_TRAIN_SCRIPT), "--max-steps=2"])
            .pod_spec(terminationGracePeriodSeconds=1).build())


# name -> (body, substring of the Failed condition, refused before any pod)
REFUSED = {
    "ds-no-opt-in": (deepspeed("ds-no-opt-in", opt_in=False),
                     "set the env ACCELERATE_TRAINER_DEEPSPEED_ON_CPU=1", False),
    "ds-use-cpu": (deepspeed("ds-use-cpu", use_cpu=True),
                   "use_cpu: true with distributed_type DEEPSPEED would quietly train plain DDP",
                   True),
    "fsdp-on-cpu": (fsdp("fsdp-on-cpu"), "distributed_type FSDP needs GPUs but this pod sees "
                    "none", False),
    "fsdp-use-cpu": (fsdp("fsdp-use-cpu", use_cpu=True),
                     "use_cpu: true with distributed_type FSDP would quietly train plain DDP",
                     True),
}


def image_probe() -> dict:
    return command_job("image-probe", IMAGE_PROBE, nodes=1).run_policy(backoffLimit=0).build()


@pytest.fixture(scope="module")
def namespace(kubeconfig: str) -> Iterator[str]:
    """One namespace, every job of the module applied at once."""
    name = create_namespace(kubeconfig, prefix="ds-guards")
    jobs = [body for body, _, _ in REFUSED.values()]
    apply_jobs(kubeconfig, name, [*jobs, without_gloo("ds-without-gloo"), image_probe()])
    yield name
    delete_namespace(kubeconfig, name)


def test_deepspeed_and_fsdp_on_cpu_pods_never_train_something_else(kubeconfig, namespace):
    names = [*REFUSED, "ds-without-gloo"]
    statuses = wait_until_finished(kubeconfig, namespace, names, timeout=540)
    problems = []
    for name, (_, reason, before_pods) in REFUSED.items():
        status = statuses[name]
        failed = condition({"status": status}, "Failed")
        if status["phase"] != "Failed" or reason not in failed.get("message", ""):
            problems.append(f"{name}: expected Failed naming {reason!r}: {status}")
            continue
        if failed.get("reason") != "InvalidConfig" or status.get("restarts"):
            problems.append(f"{name}: expected InvalidConfig without restarts: {status}")
        pods = pod_names(kubeconfig, namespace, name)
        if before_pods and pods:
            problems.append(f"{name}: refused before any pod, yet pods exist: {pods}")
        if not before_pods:
            log = kubectl("-n", namespace, "logs", f"{name}-0", kubeconfig=kubeconfig).stdout
            if "exit code 78" not in failed["message"] or "RANK_INFO" in log:
                problems.append(f"{name}: expected exit 78 before launch: {failed['message']}")
    assert not problems, "\n".join(problems)

    status = statuses["ds-without-gloo"]
    assert status["phase"] == "Failed", status
    log = kubectl("-n", namespace, "logs", "ds-without-gloo-0", kubeconfig=kubeconfig).stdout
    # Alone: accelerate 1.15 says DEEPSPEED, with a world of 1 (our check's own message).
    assert "the job launched world size 2 but rank 0 sees 1" in log, log[-3000:]
    assert 'InitProcessGroupKwargs(backend="gloo")' in log
    assert "NOT REACHED" not in log


def test_trainer_image_runs_deepspeed_ops_without_a_compiler(kubeconfig, namespace):
    statuses = wait_until_finished(kubeconfig, namespace, ["image-probe"], timeout=300)
    assert statuses["image-probe"]["phase"] == "Succeeded", statuses["image-probe"]
    log = kubectl("-n", namespace, "logs", "image-probe-0", kubeconfig=kubeconfig).stdout
    compilers = dict(line.split()[1:3] for line in log.splitlines()
                     if line.startswith("COMPILER "))
    assert compilers and set(compilers.values()) == {"None"}, compilers
    ops = dict(line.split()[1:3] for line in log.splitlines() if line.startswith("OP "))
    assert ops.keys() == {"cpu_adam", "deepspeed_shm_comm"}, log
    for name, path in ops.items():
        # The installed package's own extension modules, not a JIT build's.
        assert "/site-packages/deepspeed/ops/" in path and path.endswith(".so"), (name, path)
    assert "JIT_DIR False" in log, log


def pod_names(kubeconfig: str, namespace: str, name: str) -> list[str]:
    return kubectl("-n", namespace, "get", "pods", "-l",
                   f"accelerate-operator.io/job-name={name}", "-o", "name",
                   kubeconfig=kubeconfig).stdout.split()
