"""Reading a job's logs for AccelerateJobClient: the live log of a node or of all of them, the
last lines the operator archived when it restarted the group, and following the pods through
restarts. Every call goes through the request layer (request.py)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from accelerate_operator.constants import FINISHED_PHASES
from accelerate_operator.naming import logs_configmap_name, pod_name, trainer_container_name
from accelerate_operator.resources.logs import logs_key
from accelerate_trainer.contract import ATTEMPT_LABEL, JOB_NAME_LABEL

from .errors import AccelerateJobError
from .request import Requests

Job = Mapping[str, Any]


def prefix_lines(text: str, node: int) -> str:
    return "".join(f"[node {node}] {line}" for line in text.splitlines(keepends=True))


def _container(job: Job) -> str | None:
    return trainer_container_name((job.get("spec") or {}).get("template") or {})


def _nodes(job: Job, node: int | str) -> list[int]:
    count = int((job.get("spec") or {}).get("numNodes", 1))
    if node == "all":
        return list(range(count))
    try:
        index = int(node)
    except (TypeError, ValueError):
        index = -1
    if not 0 <= index < count:
        raise AccelerateJobError(
            f"AccelerateJob {job['metadata']['name']} has {count} node(s): pick a node from "
            f"0 to {count - 1}, or all of them")
    return [index]


def _archive_hint(job: Job) -> str:
    if not int((job.get("status") or {}).get("restarts") or 0):
        return ""
    return (f"; logs of earlier attempts: `accelerate-job logs {job['metadata']['name']} "
            "--attempt N`")


class LogReader:
    def __init__(self, requests: Requests, get_job: Callable[[str], Job]):
        self.requests = requests
        self.namespace = requests.namespace
        self._get_job = get_job

    def logs(self, job: Job, node: int | str, *, follow: bool, attempt: int | None,
             tail_lines: int | None) -> str | Iterator[str]:
        nodes, prefix = _nodes(job, node), node == "all"
        if attempt is not None:
            if follow:
                raise AccelerateJobError("--follow and --attempt do not mix: an archived log is "
                                         "complete; drop --follow")
            return self._archived(job, nodes, prefix, attempt)
        if follow:
            return self._follow(job, nodes, prefix)
        texts = (self._pod_log(job, index, tail_lines) for index in nodes)
        return "".join(prefix_lines(text, index) if prefix else text
                       for index, text in zip(nodes, texts, strict=True))

    def _pod_log(self, job: Job, index: int, tail_lines: int | None) -> str:
        name = job["metadata"]["name"]
        pod = pod_name(name, index)
        phase = (job.get("status") or {}).get("phase") or "Pending"
        missing = AccelerateJobError(
            f"pod {pod} of AccelerateJob {name} does not exist (the job is {phase}); "
            + ("its pods were cleaned up" if phase in FINISHED_PHASES
               else "it is being created: try again, or use --follow")
            + _archive_hint(job))
        def not_started(message: str) -> AccelerateJobError:
            return AccelerateJobError(f"pod {pod} has not started yet ({message}); try again, "
                                      "or use --follow to wait for it")

        return self.requests.call(
            f"read the log of pod {pod}", self.requests.core.read_namespaced_pod_log, pod,
            self.namespace, container=_container(job), tail_lines=tail_lines,
            errors={404: missing, 400: not_started}) or ""

    def archived_attempts(self, name: str) -> list[int]:
        """The attempts whose logs the operator archived before restarting the group."""
        result = self.requests.call(
            "list ConfigMaps", self.requests.core.list_namespaced_config_map, self.namespace,
            label_selector=f"{JOB_NAME_LABEL}={name},{ATTEMPT_LABEL}",
            failure=f"cannot list the archived logs of {name}")
        attempts = []
        for item in result.items:
            label = (item.metadata.labels or {}).get(ATTEMPT_LABEL, "")
            if label.isdigit() and item.metadata.name == logs_configmap_name(name, int(label)):
                attempts.append(int(label))
        return sorted(attempts)

    def _archived(self, job: Job, nodes: list[int], prefix: bool, attempt: int) -> str:
        name = job["metadata"]["name"]
        cm_name = logs_configmap_name(name, attempt)
        configmap = self.requests.call(
            f"read ConfigMap {cm_name}", self.requests.core.read_namespaced_config_map,
            cm_name, self.namespace, answers={404: None})
        if configmap is None:
            archived = self.archived_attempts(name)
            current = (job.get("status") or {}).get("attempt", 0)
            raise AccelerateJobError(
                f"no archived logs for attempt {attempt} of AccelerateJob {name} (archived: "
                f"{', '.join(map(str, archived)) or 'none'}); the operator archives a group's logs "
                f"when it restarts it, and the current attempt ({current}) is read without "
                "--attempt")
        data = configmap.data or {}
        texts = (data.get(logs_key(pod_name(name, index)), "") for index in nodes)
        return "".join(prefix_lines(text, index) if prefix else text
                       for index, text in zip(nodes, texts, strict=True))

    def _follow(self, job: Job, nodes: list[int], prefix: bool) -> Iterator[str]:
        if len(nodes) == 1:
            lines = self._follow_pod(job, nodes[0])
            yield from (f"[node {nodes[0]}] {line}" for line in lines) if prefix else lines
            return
        # One thread per pod; lines reach the caller as they come, whichever pod they are from.
        out: queue.Queue[tuple[int, str | None]] = queue.Queue(maxsize=10000)
        stop = threading.Event()

        def pump(index: int) -> None:
            try:
                for line in self._follow_pod(job, index, stop):
                    out.put((index, line))
            except AccelerateJobError as error:
                out.put((index, f"error: {error}"))
            finally:
                out.put((index, None))

        for index in nodes:
            threading.Thread(target=pump, args=(index,), daemon=True).start()
        running = len(nodes)
        try:
            while running:
                index, line = out.get()
                if line is None:
                    running -= 1
                else:
                    yield f"[node {index}] {line}"
        finally:
            stop.set()

    def _follow_pod(self, job: Job, index: int,
                    stop: threading.Event | None = None) -> Iterator[str]:
        """Stream pod `<job>-<index>`'s log; when the pod ends, follow its replacement (the next
        attempt) until the job finishes."""
        name = job["metadata"]["name"]
        pod = pod_name(name, index)
        streamed: set[str] = set()
        while not (stop and stop.is_set()):
            current = self.requests.call(f"read pod {pod}", self.requests.core.read_namespaced_pod,
                                         pod, self.namespace, answers={404: None})
            started = current is not None and current.status.phase != "Pending"
            if started and current.metadata.uid not in streamed:
                if streamed:
                    attempt = (current.metadata.labels or {}).get(ATTEMPT_LABEL, "?")
                    yield f"--- {pod} restarted (attempt {attempt}) ---"
                streamed.add(current.metadata.uid)
                yield from self._stream(pod, _container(job), stop)
                continue
            if (self._get_job(name).get("status") or {}).get("phase") in FINISHED_PHASES:
                return
            time.sleep(1.0)

    def _stream(self, pod: str, container: str | None,
                stop: threading.Event | None) -> Iterator[str]:
        response = self.requests.call(
            f"follow the log of pod {pod}", self.requests.core.read_namespaced_pod_log, pod,
            self.namespace, container=container, follow=True, _preload_content=False,
            answers={400: None, 404: None})  # gone or not started: the caller looks again
        if response is None:
            return
        buffer = b""
        try:
            for chunk in response.stream(4096):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    yield line.decode(errors="replace")
                if stop and stop.is_set():
                    return
            if buffer:
                yield buffer.decode(errors="replace")
        finally:
            response.release_conn()
