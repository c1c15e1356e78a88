"""End to end: two operator replicas (the chart's default), kopf's peering keeping one active.
The active operator's pod is deleted while the CPU example trains; the standby resumes and acts
(it writes the job's progress), the job ends Succeeded, and nothing was created twice: the same
pods (uids) trained from start to end, no restart, one ConfigMap and Service, one PodsCreated
event. Reports keep arriving: pod 0 POSTs its progress to the operator's report endpoint (the
Service in front of both replicas), the standby answers 503 until it is the active one, the pod
retries, and the status shows steps past the one of the deletion within seconds of the resume;
the last report is the job's final progress. Prints what failover cost: deletion -> standby
resumed -> its first status write -> the first report it took."""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timezone

import yaml

from devtools.cluster import ROOT, kubectl, wait_for
from tests.helpers.operator import OPERATOR_NAMESPACE, active_operator, get_json

EXAMPLE = ROOT / "examples" / "cpu-ddp.yaml"
# What the operator (peering.py, not kopf) logs when this replica starts running passes.
RESUMED = "running passes: this replica is active"


def log_time(line: str) -> float:
    stamp = line.split(" ", 1)[0]
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    when = datetime.fromisoformat(whole).replace(tzinfo=timezone.utc)
    return when.timestamp() + float(f"0.{fraction or 0}")


def test_the_standby_operator_takes_over_while_a_job_trains_and_nothing_is_made_twice(
        kubeconfig: str, namespace: str):
    job = yaml.safe_load(EXAMPLE.read_text())
    job["spec"]["template"]["spec"]["containers"][0]["args"] = [
        a if not a.startswith("--max-steps") else "--max-steps=160"
        for a in job["spec"]["template"]["spec"]["containers"][0]["args"]]
    kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump(job), kubeconfig=kubeconfig)
    name = job["metadata"]["name"]

    def status() -> dict:
        job_now = get_json(kubeconfig, "-n", namespace, "get", "acceleratejob", name)
        return job_now.get("status") or {}

    wait_for(lambda: (status().get("progress") or {}).get("step", 0) > 0, timeout=300,
             description="the job to train and report progress")
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in get_json(
        kubeconfig, "-n", namespace, "get", "pods", "-l",
        f"accelerate-operator.io/job-name={name}")["items"]}
    active, pods = active_operator(kubeconfig)
    standby = next(p for p in pods if p != active)
    progress_before = status()["progress"]["updateTime"]
    step_before = status()["progress"]["step"]

    deleted_at = time.time()
    kubectl("-n", OPERATOR_NAMESPACE, "delete", "pod", active, "--wait=false",
            kubeconfig=kubeconfig)

    def resumed_line() -> str | None:
        text = kubectl("-n", OPERATOR_NAMESPACE, "logs", standby, "--timestamps",
                       kubeconfig=kubeconfig).stdout
        return next((line for line in text.splitlines()
                     if RESUMED in line and log_time(line) >= deleted_at - 1),
                    None)

    line = wait_for(resumed_line, timeout=120, interval=0.5,
                    description=f"the standby {standby} to resume")
    resumed_after = log_time(line) - deleted_at
    wait_for(lambda: status().get("phase") in ("Succeeded", "Failed") or
             (status().get("progress") or {}).get("updateTime") != progress_before,
             timeout=120, interval=0.5, description="the standby's first write to the job")
    acted_after = time.time() - deleted_at
    # A report the new active replica took: a step past the one of the deletion (the job has
    # 160 steps and trains several a second: still running here, or done and its last report in)
    wait_for(lambda: (status().get("progress") or {}).get("step", 0) > step_before, timeout=30,
             interval=0.5, description=f"a step past {step_before} reported to the new replica")
    reported_after = time.time() - deleted_at
    print(f"\nFAILOVER deleted -> standby resumed {resumed_after:.1f} s, "
          f"-> its first status write {acted_after:.1f} s, -> a newer step reported "
          f"{reported_after:.1f} s")

    waited = kubectl("-n", namespace, "wait", "--for=condition=Succeeded",
                     f"acceleratejob/{name}", "--timeout=600s", kubeconfig=kubeconfig,
                     check=False, timeout=660)
    final = status()
    assert waited.returncode == 0, json.dumps(final, indent=1)
    assert final["restarts"] == 0 and final["attempt"] == 0, final
    assert final["progress"]["summary"] == "160/160 (100%)", final["progress"]
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in get_json(
        kubeconfig, "-n", namespace, "get", "pods", "-l",
        f"accelerate-operator.io/job-name={name}")["items"]}
    assert after == before  # the same two pods trained start to end
    children = kubectl("-n", namespace, "get", "configmaps,services", "-l",
                       f"accelerate-operator.io/job-name={name}", "-o", "name",
                       kubeconfig=kubeconfig).stdout.split()
    assert sorted(children) == [f"configmap/{name}-accelerate-config", f"service/{name}"]
    events = get_json(kubeconfig, "-n", namespace, "get", "events", "--field-selector",
                      "involvedObject.kind=AccelerateJob")["items"]
    reasons = [e["reason"] for e in events]
    assert reasons.count("PodsCreated") == 1 and reasons.count("AllNodesSucceeded") == 1, reasons
    assert resumed_after < 30, f"the standby resumed {resumed_after:.1f} s after the deletion"
    # Both replicas serve again (the Deployment replaced the deleted one) and one is active.
    wait_for(lambda: len(active_operator(kubeconfig)[1]) == 2, timeout=120,
             description="the Deployment's replacement replica")
    assert re.match(r"accelerate-operator-", active_operator(kubeconfig)[0])
