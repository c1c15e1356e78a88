"""Fluent factories for AccelerateJob bodies and pod states (model: jobset's testing wrappers)."""

from __future__ import annotations

import copy
import json
from typing import Any

import yaml
from accelerate_operator.constants import API_VERSION, KIND
from accelerate_operator.pod_state import PodState

from devtools.images import TRAINER_CPU_IMAGE
from tests.helpers.shared_volume import SharedDir

# A scheduler no cluster runs: the pods stay Pending with no node and no kubelet, and a test
# sets their status itself (as jobset's integration tests do under envtest).
NO_SCHEDULER = "accelerate-operator.io/no-scheduler"


class JobBuilder:
    """`JobBuilder("train").nodes(2).procs(2).build()` -> an AccelerateJob body; the one factory
    of job bodies for every test (model: jobset's pkg/util/testing/wrappers.go)."""

    def __init__(self, name: str = "train", namespace: str = "ml"):
        self.server_owned = True  # uid and generation, as a unit test's parse_job wants them
        self.body: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}",
                         "generation": 1},
            "spec": {
                "numNodes": 2,
                "numProcPerNode": 2,
                "masterPort": 29500,
                "accelerateConfig": {"distributed_type": "MULTI_CPU", "use_cpu": True},
                "runPolicy": {"backoffLimit": 3, "cleanPodPolicy": "Running", "suspend": False},
                "template": {"spec": {"containers": [{
                    "name": "trainer", "image": TRAINER_CPU_IMAGE,
                    "command": ["accelerate-trainer"], "args": ["train.py"],
                }]}},
            },
        }

    @classmethod
    def from_example(cls, name: str, example: str = "cpu-ddp.yaml") -> JobBuilder:
        """An example of examples/ as the user applies it, under another name."""
        from devtools.cluster import ROOT

        builder = cls(name).for_server()
        builder.body = yaml.safe_load((ROOT / "examples" / example).read_text())
        builder.body["metadata"] = {"name": name}
        return builder

    def nodes(self, n: int) -> JobBuilder:
        self.body["spec"]["numNodes"] = n
        return self

    def procs(self, n: int | str) -> JobBuilder:
        self.body["spec"]["numProcPerNode"] = n
        return self

    def config(self, **values: Any) -> JobBuilder:
        self.body["spec"]["accelerateConfig"] = dict(values)
        return self

    def config_from(self, name: str, key: str) -> JobBuilder:
        self.body["spec"].pop("accelerateConfig", None)
        self.body["spec"]["accelerateConfigFrom"] = {"configMapKeyRef": {"name": name, "key": key}}
        return self

    def run_policy(self, **values: Any) -> JobBuilder:
        self.body["spec"]["runPolicy"].update(values)
        return self

    def container(self, **values: Any) -> JobBuilder:
        self.body["spec"]["template"]["spec"]["containers"][0].update(values)
        return self

    def pod_spec(self, **values: Any) -> JobBuilder:
        self.body["spec"]["template"]["spec"].update(values)
        return self

    def volume(self, **volume: Any) -> JobBuilder:
        self.body["spec"]["template"]["spec"].setdefault("volumes", []).append(volume)
        return self

    def checkpoint(self, volume: str, mount_path: str = "/checkpoints") -> JobBuilder:
        self.body["spec"]["checkpoint"] = {"volumeName": volume, "mountPath": mount_path}
        return self

    def elastic(self, min_nodes: int, accumulation: int, **fields: Any) -> JobBuilder:
        """spec.elastic, with a checkpoint volume (an elastic job needs one)."""
        self.body["spec"]["elastic"] = {"minNodes": min_nodes,
                                        "gradientAccumulationSteps": accumulation, **fields}
        if "checkpoint" not in self.body["spec"]:
            self.volume(name="ckpt", emptyDir={}).checkpoint("ckpt")
        return self

    def spec(self, **fields: Any) -> JobBuilder:
        self.body["spec"].update(fields)
        return self

    def unset(self, *fields: str) -> JobBuilder:
        """Leave spec fields to the server's defaults (or to the accelerate config)."""
        for name in fields:
            self.body["spec"].pop(name, None)
        return self

    def args(self, *args: str) -> JobBuilder:
        return self.container(args=list(args))

    def env(self, **values: str) -> JobBuilder:
        container = self.body["spec"]["template"]["spec"]["containers"][0]
        container.setdefault("env", []).extend({"name": k, "value": v} for k, v in values.items())
        return self

    def labels(self, **labels: str) -> JobBuilder:
        self.body["metadata"].setdefault("labels", {}).update(labels)
        return self

    def queue(self, local_queue: str) -> JobBuilder:
        """Queued with Kueue: the LocalQueue label."""
        return self.labels(**{"kueue.x-k8s.io/queue-name": local_queue})

    def image(self, image: str) -> JobBuilder:
        return self.container(image=image)

    def command(self, script: str) -> JobBuilder:
        """The trainer replaced by a Python snippet (`python3 -c script`)."""
        return self.container(command=["python3", "-c", script], args=[])

    def grace(self, seconds: int) -> JobBuilder:
        return self.pod_spec(terminationGracePeriodSeconds=seconds)

    def unscheduled(self) -> JobBuilder:
        """Pods no scheduler places and no kubelet runs: the test sets their status."""
        return self.pod_spec(schedulerName=NO_SCHEDULER)

    def for_server(self, namespace: str | None = None) -> JobBuilder:
        """Without uid and generation (the API server owns them), in `namespace` or in none
        (the one kubectl is given)."""
        self.server_owned = False
        self.body["metadata"].pop("namespace", None)
        if namespace:
            self.body["metadata"]["namespace"] = namespace
        return self

    def build(self) -> dict[str, Any]:
        body = copy.deepcopy(self.body)
        if not self.server_owned:
            body["metadata"] = {k: v for k, v in body["metadata"].items()
                                if k not in ("uid", "generation")}
        return body


def pod(job: str, index: int, phase: str = "Running", *, attempt: int = 0,
        ready: bool | None = None,
        exit_code: int | None = None, reason: str | None = None, message: str | None = None,
        deleting: bool = False, node: str | None = None) -> PodState:
    return PodState(
        name=f"{job}-{index}", index=index, attempt=attempt, phase=phase,
        ready=(phase == "Running") if ready is None else ready, deleting=deleting,
        exit_code=exit_code, reason=reason, message=message, node=node,
    )


def command_job(name: str, script: str, *, nodes: int = 2) -> JobBuilder:
    """A job whose pods run a cheap Python snippet instead of training: for tests of the
    operator's behaviour, where real training would only cost time."""
    # A snippet is PID 1 of its container, which ignores SIGTERM unless it handles it, and it
    # saves no checkpoint: a short grace period, not the 120 s default that fits a checkpoint,
    # so a restart or a deletion does not wait for it.
    return JobBuilder(name).nodes(nodes).procs(1).command(script).grace(5)


def apply_job(kubeconfig: str, namespace: str, body: dict) -> None:
    from devtools.cluster import kubectl

    body = copy.deepcopy(body)
    # The job's own labels and annotations stay (a Kueue queue label, say); the namespace is
    # the test's.
    body["metadata"] = {**body["metadata"], "namespace": namespace}
    kubectl("-n", namespace, "apply", "-f", "-", kubeconfig=kubeconfig, input=json.dumps(body))


def apply_jobs(kubeconfig: str, namespace: str, bodies: list[dict]) -> None:
    """Several jobs in one kubectl call, so that they start side by side."""
    from devtools.cluster import kubectl

    # What a user's manifest holds: a name, labels and annotations (a Kueue queue label, say),
    # in the test's namespace; never a uid or generation, which the API server owns.
    items = [{**body, "metadata": {**{k: v for k, v in body["metadata"].items()
                                      if k in ("name", "labels", "annotations")},
                                   "namespace": namespace}} for body in bodies]
    kubectl("-n", namespace, "apply", "-f", "-", kubeconfig=kubeconfig,
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))


def get_job(kubeconfig: str, namespace: str, name: str) -> dict:
    from devtools.cluster import kubectl

    out = kubectl("-n", namespace, "get", "acceleratejob", name, "-o", "json",
                  kubeconfig=kubeconfig, check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def wait_for_job(kubeconfig: str, namespace: str, name: str, predicate, *, timeout: float = 120,
                 description: str = "") -> dict:
    """Poll the job until `predicate(job)` holds; the failure message shows the last status."""
    from devtools.cluster import wait_for

    last: dict = {}

    def check():
        nonlocal last
        last = get_job(kubeconfig, namespace, name)
        return last if last and predicate(last) else None

    try:
        return wait_for(check, timeout=timeout, interval=0.5,
                        description=description or f"job {name}")
    except AssertionError as error:
        raise AssertionError(
            f"{error}; last status: {json.dumps(last.get('status'), indent=1)}; "
            f"events:\n{recent_events(kubeconfig, namespace)}") from None


def recent_events(kubeconfig: str, namespace: str, count: int = 30) -> str:
    """The namespace's newest events, a line each, oldest first: what happened to the job and
    its pods, for a failure message that CI shows without the cluster."""
    from devtools.cluster import kubectl

    out = kubectl("-n", namespace, "get", "events", "-o", "json", kubeconfig=kubeconfig,
                  check=False)
    items = json.loads(out.stdout).get("items", []) if out.returncode == 0 else []
    when = lambda e: e.get("lastTimestamp") or e.get("eventTime") or ""  # noqa: E731
    return "\n".join(
        f"{when(e)[11:19]} {e.get('type')} {e.get('reason')} "
        f"{e['involvedObject'].get('name')} (x{e.get('count') or 1}): "
        f"{(e.get('message') or '')[:240]}" for e in sorted(items, key=when)[-count:])


def attempt_log(kubeconfig: str, namespace: str, job: str, attempt: int, pod: str) -> str:
    """What a pod of a group since replaced printed (the operator's archive of its last lines)."""
    from devtools.cluster import kubectl

    archive = json.loads(kubectl("-n", namespace, "get", "configmap",
                                 f"{job}-logs-attempt-{attempt}", "-o", "json",
                                 kubeconfig=kubeconfig).stdout)
    return archive["data"][f"{pod}.log"]


def job_statuses(kubeconfig: str, namespace: str) -> dict[str, dict]:
    """Every job of the namespace by name, its status, from one list call."""
    from devtools.cluster import kubectl

    out = kubectl("-n", namespace, "get", "acceleratejobs", "-o", "json", kubeconfig=kubeconfig)
    return {item["metadata"]["name"]: item.get("status") or {}
            for item in json.loads(out.stdout)["items"]}


def wait_until_finished(kubeconfig: str, namespace: str, names, *, timeout: float) -> dict:
    """The statuses of `names` once each is Succeeded or Failed (one list call a poll)."""
    from devtools.cluster import wait_for

    def finished():
        statuses = job_statuses(kubeconfig, namespace)
        done = all(statuses.get(name, {}).get("phase") in ("Succeeded", "Failed")
                   for name in names)
        return statuses if done else None

    return wait_for(finished, timeout=timeout, interval=2,
                    description=f"{len(names)} jobs of {namespace} to finish")


def follow_jobs(kubeconfig: str, namespace: str, stages: dict, *, timeout: float,
                seen: dict | None = None) -> dict:
    """Each job's stages, in order, from one list call a poll: `stages` maps a job's name to
    [(stage, predicate(status, seen))]; returns `seen`, each stage's name to the time it was first
    seen (time.time()) and the job's status then. A predicate may compare with a stage seen
    before it (in `seen`), so several jobs' timelines are followed at once, none polled late."""
    import time

    from devtools.cluster import wait_for

    seen = {} if seen is None else seen
    pending = {job: list(queue) for job, queue in stages.items()}
    last: dict = {}

    def check() -> bool:
        nonlocal last
        last, now = job_statuses(kubeconfig, namespace), time.time()
        for job, queue in pending.items():
            while queue and last.get(job) and queue[0][1](last[job], seen):
                seen[queue.pop(0)[0]] = (now, last[job])
        return not any(pending.values())

    try:
        wait_for(check, timeout=timeout, interval=0.5, description="the jobs' stages")
    except AssertionError as error:
        waiting = {job: queue[0][0] for job, queue in pending.items() if queue}
        raise AssertionError(
            f"{error}: still waiting for {waiting}; last statuses: {json.dumps(last, indent=1)}; "
            f"events:\n{recent_events(kubeconfig, namespace)}") from None
    return seen


def phase_is(*phases: str):
    return lambda job: job.get("status", {}).get("phase") in phases


def condition(job: dict, type_: str) -> dict:
    return next((c for c in job.get("status", {}).get("conditions", []) if c["type"] == type_), {})


def checkpointed_job(name: str, shared: SharedDir, *args: str) -> dict:
    """The CPU example with a checkpoint folder both nodes share (tests/helpers/shared_volume.py),
    writable by the image's non-root user."""
    return (JobBuilder.from_example(name).run_policy(backoffLimit=1, cleanPodPolicy="None")
            .checkpoint("checkpoints", "/checkpoints").volume(**shared.volume())
            .args("/opt/accelerate/examples/train.py", *args).build())
