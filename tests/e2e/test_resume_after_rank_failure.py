"""Kill one rank in the middle of real training: the whole group restarts, resumes from the last
complete checkpoint, and finishes exactly the planned steps, losing at most one checkpoint
interval."""

from __future__ import annotations

import json
import re
from datetime import datetime

from devtools.cluster import kubectl
from tests.helpers.jobs import JobBuilder, apply_job, phase_is, shared_dir, wait_for_job

MAX_STEPS, CHECKPOINT_EVERY, FAIL_AT = 30, 10, 25


def resumable_job(checkpoint_host_dir: str) -> dict:
    return (JobBuilder.from_example("resume").run_policy(backoffLimit=2, cleanPodPolicy="None")
            .checkpoint("checkpoints", "/checkpoints")
            .volume(name="checkpoints",
                    hostPath={"path": checkpoint_host_dir, "type": "DirectoryOrCreate"})
            .args("/opt/accelerate/examples/train.py", f"--max-steps={MAX_STEPS}",
                  "--log-every=1", f"--checkpoint-every={CHECKPOINT_EVERY}",
                  f"--fail-at-step={FAIL_AT}", "--fail-rank=3")
            .env(ACCELERATE_FAIL_ONCE_MARKER="/checkpoints/failed-once")
            .build())


def recovery_seconds(kubeconfig: str, namespace: str) -> float:
    """From the operator seeing the failure to the new group running, by the job's events."""
    out = kubectl("-n", namespace, "get", "events", "--field-selector",
                  "involvedObject.name=resume", "-o", "json", kubeconfig=kubeconfig)
    events = sorted(json.loads(out.stdout)["items"], key=lambda e: e["lastTimestamp"])
    stamp = lambda e: datetime.strptime(e["lastTimestamp"], "%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    failed = next(e for e in events if e["reason"] == "PodFailed")
    running = next(e for e in events if e["reason"] == "AllNodesRunning"
                   and stamp(e) >= stamp(failed) and e is not failed)
    return (stamp(running) - stamp(failed)).total_seconds()


def test_killed_rank_restarts_the_group_which_resumes_from_the_last_checkpoint(
        kubeconfig, namespace):
    # A host folder both nodes mount (the local nodes share the host's disk, as pods share an
    # NFS volume), writable by the image's non-root trainer user.
    host_dir = shared_dir()
    apply_job(kubeconfig, namespace, resumable_job(str(host_dir)))
    done = wait_for_job(kubeconfig, namespace, "resume", phase_is("Succeeded", "Failed"),
                        timeout=900, description="the resumed job to finish")
    status = done["status"]
    assert status["phase"] == "Succeeded", status
    assert status["restarts"] == 1
    # Rank 3 (pod resume-1) dies; over gloo the ranks of resume-0 see "Connection closed by
    # peer" at once and exit 1 too. Both pods end within a fraction of a second (fast_exit), so
    # the first one the kubelet reports is either.
    assert re.match(r"pod resume-[01] failed with exit code 1: ", status["lastFailure"]), status

    log = kubectl("-n", namespace, "logs", "resume-0", kubeconfig=kubeconfig).stdout
    resumed = re.search(r"RESUMED from=(\S+) step=(\d+)", log)
    assert resumed, log[-3000:]
    resumed_step = int(resumed.group(2))
    assert resumed.group(1).startswith("/checkpoints/checkpoints/checkpoint_")
    steps_lost = FAIL_AT - resumed_step
    assert 0 <= steps_lost <= CHECKPOINT_EVERY, (FAIL_AT, resumed_step)
    assert re.search(rf"TRAINING_DONE steps={MAX_STEPS} ", log), log[-2000:]
    # Every step after the resume point was trained exactly once in the second attempt.
    steps = [int(s) for s in re.findall(r"STEP step=(\d+)", log)]
    assert steps == list(range(resumed_step + 1, MAX_STEPS + 1))
    checkpoints = sorted(p.name for p in (host_dir / "checkpoints").iterdir())
    assert all((host_dir / "checkpoints" / c / "COMPLETE").exists() for c in checkpoints)
    # The fault shows in the job's goodput: one interruption, its recovery, what was lost.
    goodput = status["goodput"]
    assert goodput["interruptions"] == 1 and goodput["lastRecoverySeconds"] > 0, goodput
    assert goodput["lostSeconds"]["recovery"] >= goodput["lastRecoverySeconds"], goodput
    assert 0 < goodput["percent"] < 100, goodput
    table = kubectl("-n", namespace, "get", "ajob", "resume", kubeconfig=kubeconfig).stdout
    assert re.search(r"GOODPUT", table) and goodput["summary"] in table, table
    described = kubectl("-n", namespace, "describe", "ajob", "resume",
                        kubeconfig=kubeconfig).stdout
    assert "Goodput:" in described and "Last Recovery Seconds:" in described, described
    recovery = recovery_seconds(kubeconfig, namespace)
    print(f"\nkill-a-rank: planned {MAX_STEPS} steps, failed at step {FAIL_AT}, resumed from "
          f"step {resumed_step} (lost {steps_lost} steps), group running again "
          f"{recovery:.0f}s after the failure was seen; goodput {goodput['summary']}, "
          f"lost {goodput['lostSeconds']}")
