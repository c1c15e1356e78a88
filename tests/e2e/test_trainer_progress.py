"""End to end: an unmodified `transformers.Trainer` script (examples/trainer_example.py, shipped in
the trainer image) reports PROGRESS, ETA and its latest metrics to `kubectl get ajob`: transformers'
KubeflowCallback POSTs KEP-2779's trainerStatus straight to the operator's report endpoint (pod 0
gets its URL, token and CA), with no progress code in the script.

Two nodes x two processes on CPU, paced: few steps and a long sleep after each, so that the run
lasts about a minute with its CPUs mostly idle (beside another module's training a step's own
work takes about 0.3 s, so many short-slept steps would last minutes), and the callback's 5 s
posts and the operator's status writes see several mid-run values; then 100 % at the end."""

from __future__ import annotations

import re

import pytest

from devtools.cluster import kubectl, kubectl_json, wait_for
from devtools.images import TRAINER_CPU_IMAGE
from tests.helpers.jobs import JobBuilder, apply_job, get_job, phase_is, wait_for_job

pytestmark = [pytest.mark.timeout(600)]

IMAGE = TRAINER_CPU_IMAGE
NAME = "hf-trainer"
MAX_STEPS = 120
JOB = (JobBuilder(NAME).for_server().nodes(2).procs(2).unset("masterPort")
       .config(compute_environment="LOCAL_MACHINE", distributed_type="MULTI_CPU", use_cpu=True,
               mixed_precision="no")
       .run_policy(backoffLimit=0, cleanPodPolicy="None")
       .pod_spec(securityContext={"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000,
                                  "seccompProfile": {"type": "RuntimeDefault"}},
                 volumes=[{"name": "workspace", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}])
       .image(IMAGE)
       .args("/opt/accelerate/examples/trainer_example.py", f"--max-steps={MAX_STEPS}",
             "--batch-size=4", "--seq-len=32", "--sleep-per-step=0.4")
       .env(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
       .container(imagePullPolicy="IfNotPresent",
                  resources={"requests": {"cpu": "250m", "memory": "1Gi"},
                             "limits": {"memory": "4Gi"}},
                  securityContext={"allowPrivilegeEscalation": False,
                                   "readOnlyRootFilesystem": True,
                                   "capabilities": {"drop": ["ALL"]}},
                  volumeMounts=[{"name": "workspace", "mountPath": "/workspace"},
                                {"name": "tmp", "mountPath": "/tmp"}])
       .build())
ROW = re.compile(rf"(\d+)/{MAX_STEPS} \((\d+)%\)")


def test_an_unmodified_trainer_script_shows_rising_progress_an_eta_and_100_percent(
        kubeconfig, namespace):
    apply_job(kubeconfig, namespace, JOB)
    seen: list[tuple[int, str]] = []

    def progress_row():
        row = kubectl("-n", namespace, "get", "ajob", NAME, "--no-headers",
                      kubeconfig=kubeconfig).stdout
        match = ROW.search(row)
        if match and 0 < int(match.group(1)) < MAX_STEPS:
            eta = row.split(match.group(0))[1].split()[0]
            if not seen or seen[-1][0] != int(match.group(1)):
                seen.append((int(match.group(1)), eta))
                print(row.strip())
        return len(seen) >= 3 or (match and int(match.group(1)) == MAX_STEPS)

    wait_for(progress_row, timeout=420, interval=1,
             description="three mid-run PROGRESS values from transformers' callback")
    steps = [step for step, _ in seen]
    assert len(steps) >= 3 and steps == sorted(steps), seen
    assert all(re.fullmatch(r"\d+(s|m\d*s?|h\d*m?)", eta) for _, eta in seen), seen
    progress = get_job(kubeconfig, namespace, NAME)["status"]["progress"]
    assert {"learning_rate", "loss"} <= set(progress["metrics"]), progress
    assert progress["etaSeconds"] >= 0 and "loss" in progress

    job = wait_for_job(kubeconfig, namespace, NAME, phase_is("Succeeded", "Failed"),
                       timeout=420)
    assert job["status"]["phase"] == "Succeeded", job["status"]
    try:
        done = wait_for(lambda: (lambda p: p.get("step") == MAX_STEPS and p)(
            get_job(kubeconfig, namespace, NAME)["status"].get("progress") or {}), timeout=30,
            description="the last progress line in the status")
    except AssertionError as error:
        # What rank 0's log says of its last POST (transformers logs a failed one).
        log = kubectl("-n", namespace, "logs", f"{NAME}-0", kubeconfig=kubeconfig).stdout
        status = get_job(kubeconfig, namespace, NAME)["status"]
        raise AssertionError(f"{error}\nstatus.progress: {status.get('progress')}\n"
                             f"rank 0's log ends: {log.splitlines()[-15:]}") from None
    assert done["summary"] == f"{MAX_STEPS}/{MAX_STEPS} (100%)" and done["eta"] == "0s"
    # transformers' KubeflowCallback posted to the operator's endpoint itself, no relay between
    pod = kubectl_json("-n", namespace, "get", "pod", f"{NAME}-0", kubeconfig=kubeconfig)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["KUBEFLOW_TRAINER_SERVER_URL"] == env["ACCELERATE_REPORT_URL"]
    assert env["KUBEFLOW_TRAINER_SERVER_URL"].startswith("https://accelerate-operator.")

