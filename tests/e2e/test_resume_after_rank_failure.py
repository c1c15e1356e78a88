"""Kill one rank in the middle of real training: the group's processes restart in the same pods
(spec.runPolicy.restartInPlace, the default), resume from the last complete checkpoint, and
finish exactly the planned steps, losing at most one checkpoint interval."""

from __future__ import annotations

import json
import re
from datetime import datetime

from devtools.cluster import kubectl
from tests.helpers.jobs import JobBuilder, apply_job, phase_is, wait_for_job
from tests.helpers.shared_volume import SharedDir, shared_dir

MAX_STEPS, CHECKPOINT_EVERY, FAIL_AT = 30, 10, 25
# Goodput counts training between two reports whose steps advanced, and pod 0 reports at most
# every 8 s: at a fraction of a second per step, an attempt can end before its second report,
# and a loaded `make test` saw 0.0% for this job. Half a second per step (the first attempt
# trains 25 steps, the second 10) gives each attempt more than one report.
SECONDS_PER_STEP = 0.5


def resumable_job(shared: SharedDir) -> dict:
    return (JobBuilder.from_example("resume").run_policy(backoffLimit=2, cleanPodPolicy="None")
            .checkpoint("checkpoints", "/checkpoints").volume(**shared.volume())
            .args("/opt/accelerate/examples/train.py", f"--max-steps={MAX_STEPS}",
                  "--log-every=1", f"--checkpoint-every={CHECKPOINT_EVERY}",
                  f"--fail-at-step={FAIL_AT}", "--fail-rank=3",
                  f"--sleep-per-step={SECONDS_PER_STEP}")
            .env(ACCELERATE_FAIL_ONCE_MARKER="/checkpoints/failed-once")
            .build())


def seconds_without_a_step(log: str) -> float:
    """From rank 0's last step before the failure to its first step after the resume, by the
    kubelet's timestamps of pod 0's log lines (both attempts ran in that one container)."""
    stamped = [(datetime.fromisoformat(line.split(" ", 1)[0].replace("Z", "+00:00")), line)
               for line in log.splitlines() if " " in line]
    resumed = next(i for i, (_, line) in enumerate(stamped) if "RESUMED from=" in line)
    before = [t for t, line in stamped[:resumed] if "STEP step=" in line][-1]
    after = next(t for t, line in stamped[resumed:] if "STEP step=" in line)
    return (after - before).total_seconds()


def test_a_killed_rank_restarts_the_processes_in_place_resuming_from_the_last_checkpoint(
        kubeconfig, namespace):
    # A folder both nodes mount, as pods share an NFS volume.
    host_dir = shared_dir(kubeconfig, namespace)
    apply_job(kubeconfig, namespace, resumable_job(host_dir))
    done = wait_for_job(kubeconfig, namespace, "resume", phase_is("Succeeded", "Failed"),
                        timeout=900, description="the resumed job to finish")
    status = done["status"]
    assert status["phase"] == "Succeeded", status
    assert (status["restarts"], status["restartsCounted"]) == (1, 1), status
    # Rank 3 (pod resume-1) dies; over gloo the ranks of resume-0 see "Connection closed by
    # peer" at once and exit 1 too. Both launches end within a fraction of a second, so the
    # first report the operator sees is either pod's. A root cause the pod found comes first,
    # before "; ".
    assert re.search(r"(^|; )pod resume-[01] ended its training processes with exit code 1",
                     status["lastFailure"]), status
    # In place: attempt 1 ran in the pods created for attempt 0, whose containers never
    # restarted.
    assert (status["attempt"], status["groupAttempt"]) == (1, 0), status
    pods = json.loads(kubectl("-n", namespace, "get", "pods", "-o", "json",
                              kubeconfig=kubeconfig).stdout)["items"]
    assert sorted(p["metadata"]["labels"]["accelerate-operator.io/attempt"] for p in pods) \
        == ["0", "0"]
    assert all(c["restartCount"] == 0 for p in pods for c in p["status"]["containerStatuses"])
    events = kubectl("-n", namespace, "get", "events", "--field-selector",
                     "involvedObject.name=resume", kubeconfig=kubeconfig).stdout
    assert "ProcessFailed" in events and "PodFailed" not in events, events

    stamped = kubectl("-n", namespace, "logs", "--timestamps", "resume-0",
                      kubeconfig=kubeconfig).stdout
    log = "\n".join(line.split(" ", 1)[-1] for line in stamped.splitlines())
    resumed = re.search(r"RESUMED from=(\S+) step=(\d+)", log)
    assert resumed, log[-3000:]
    resumed_step = int(resumed.group(2))
    assert resumed.group(1).startswith("/checkpoints/checkpoints/checkpoint_")
    steps_lost = FAIL_AT - resumed_step
    assert 0 <= steps_lost <= CHECKPOINT_EVERY, (FAIL_AT, resumed_step)
    assert re.search(rf"TRAINING_DONE steps={MAX_STEPS} ", log), log[-2000:]
    # Every step after the resume point was trained exactly once in the second attempt.
    steps = [int(s) for s in re.findall(r"STEP step=(\d+)", log[resumed.start():])]
    assert steps == list(range(resumed_step + 1, MAX_STEPS + 1))
    files = host_dir.files(kubeconfig, namespace)
    checkpoints = {path.split("/")[1] for path in files if path.startswith("checkpoints/")}
    assert checkpoints and all(f"checkpoints/{c}/COMPLETE" in files for c in checkpoints), files
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
    gap = seconds_without_a_step(stamped)
    # The status's recovery runs from the last step the failed attempt reported (its progress
    # lines come at most every 2 s) to the new attempt's first: the log's own gap, within that.
    assert abs(goodput["lastRecoverySeconds"] - gap) <= 4, (goodput, gap)
    print(f"\nkill-a-rank: planned {MAX_STEPS} steps, failed at step {FAIL_AT}, resumed from "
          f"step {resumed_step} (lost {steps_lost} steps), restarted in place: {gap:.1f}s "
          f"without a step; goodput {goodput['summary']}, lost {goodput['lostSeconds']}")
