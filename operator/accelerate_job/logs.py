"""Reading a job's logs for AccelerateJobClient: the live log of a node or of all of them, the
last lines the operator archived when it restarted the group, and following the pods through
restarts with watches and follow streams (no polling). Every call goes through the request
layer (request.py)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from accelerate_operator.constants import FINISHED_PHASES, GROUP, PLURAL, VERSION
from accelerate_operator.naming import logs_configmap_name, pod_name, trainer_container_name
from accelerate_operator.resources.logs import logs_key
from accelerate_trainer.contract import ATTEMPT_LABEL, JOB_NAME_LABEL

from .errors import AccelerateJobError
from .render import node_count
from .request import Requests, WatchExpired

Job = Mapping[str, Any]


def prefix_lines(text: str, node: int) -> str:
    return "".join(f"[node {node}] {line}" for line in text.splitlines(keepends=True))


def _container(job: Job) -> str | None:
    return trainer_container_name((job.get("spec") or {}).get("template") or {})


def _nodes(job: Job, node: int | str) -> list[int]:
    count = node_count(job)
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


@dataclass(frozen=True)
class LiveLog:
    """What to read of a live pod log: which container, and kubectl's --tail and --since."""

    container: str | None
    tail_lines: int | None = None
    since_seconds: int | None = None


class LogReader:
    def __init__(self, requests: Requests, get_job: Callable[[str], Job]):
        self.requests = requests
        self.namespace = requests.namespace
        self._get_job = get_job

    def logs(self, job: Job, node: int | str, *, follow: bool, attempt: int | None,
             tail_lines: int | None, container: str | None = None,
             since_seconds: int | None = None) -> str | Iterator[str]:
        nodes, prefix = _nodes(job, node), node == "all"
        live = LiveLog(container or _container(job), tail_lines, since_seconds)
        if attempt is not None:
            if follow:
                raise AccelerateJobError("--follow and --attempt do not mix: an archived log is "
                                         "complete; drop --follow")
            return self._archived(job, nodes, prefix, attempt)
        if follow:
            return _Follower(self, job, nodes, prefix, live).lines()
        texts = (self._pod_log(job, index, live) for index in nodes)
        return "".join(prefix_lines(text, index) if prefix else text
                       for index, text in zip(nodes, texts, strict=True))

    def _pod_log(self, job: Job, index: int, live: LiveLog) -> str:
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
            self.namespace, container=live.container, tail_lines=live.tail_lines,
            since_seconds=live.since_seconds, errors={404: missing, 400: not_started}) or ""

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

    def _watch(self, list_fn: Callable[..., Any], what: str, *args: Any,
               **selectors: Any) -> Iterator[dict[str, Any] | None]:
        """Every object a namespaced list call returns (its current state), then None, then
        every one that is added or changes, for as long as the caller iterates; lists again on
        410."""
        namespaced = (*args[:2], self.namespace, *args[2:]) if args else (self.namespace,)
        while True:
            result = self.requests.call(f"list {what}", list_fn, *namespaced, **selectors)
            items = result.get("items") if isinstance(result, dict) else [
                self.requests.api_client.sanitize_for_serialization(item)
                for item in result.items]
            metadata = result.get("metadata") if isinstance(result, dict) else {
                "resourceVersion": result.metadata.resource_version}
            yield from items or []
            yield None  # the listed state is complete
            version = (metadata or {}).get("resourceVersion")
            try:
                while True:
                    for kind, body in self.requests.watch(
                            f"watch {what}", list_fn, *namespaced, resource_version=version,
                            timeout_seconds=300, allow_watch_bookmarks=True, **selectors):
                        version = (body.get("metadata") or {}).get("resourceVersion") or version
                        if kind in ("ADDED", "MODIFIED"):
                            yield body
            except WatchExpired:
                continue

    def _stream(self, pod: str, live: LiveLog) -> Iterator[str]:
        """The pod's log, following it until its container ends (a follow stream)."""
        lines = self.requests.watch(
            f"follow the log of pod {pod}", self.requests.core.read_namespaced_pod_log, pod,
            self.namespace, container=live.container, follow=True,
            since_seconds=live.since_seconds,
            errors={400: AccelerateJobError(f"pod {pod} has not started"),
                    404: AccelerateJobError(f"pod {pod} is gone")})
        for _, line in lines:
            yield line


class _Follower:
    """Follows a job's logs through restarts, never by polling: one watch on the job's pods (by
    label) starts a follow stream for each pod of a wanted node once it has started, the
    replacement of a later attempt included; one watch on the job says when it has finished. A
    stream blocks, so each runs in a thread of its own and its lines reach the caller through
    one queue, whichever pod they are from. Ends once the job has finished and every stream
    has ended."""

    def __init__(self, reader: LogReader, job: Job, nodes: list[int], prefix: bool,
                 live: LiveLog):
        self.reader, self.job, self.prefix, self.live = reader, job, prefix, live
        self.name = job["metadata"]["name"]
        self.wanted = set(nodes)
        self.out: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=10000)
        self.followed: set[str] = set()  # pod uids already streamed
        self.seen_node: set[int] = set()
        self.pods_listed = threading.Event()

    def lines(self) -> Iterator[str]:
        for target in (self._watch_pods, self._watch_job):
            threading.Thread(target=target, daemon=True).start()
        streaming, finished = 0, False
        while not (finished and streaming == 0):
            kind, value = self.out.get()
            if kind == "line":
                index, line = value
                yield f"[node {index}] {line}" if self.prefix else line
            elif kind == "started":
                streaming += 1
            elif kind == "ended":
                streaming -= 1
            elif kind == "finished":
                finished = True
            elif kind == "error":
                raise value

    def _stream_pod(self, pod: str, index: int, attempt: str) -> None:
        try:
            if index in self.seen_node:
                self.out.put(("line", (index, f"--- {pod} restarted (attempt {attempt}) ---")))
            self.seen_node.add(index)
            for line in self.reader._stream(pod, self.live):
                self.out.put(("line", (index, line)))
        except AccelerateJobError as error:
            self.out.put(("line", (index, f"error: {error}")))
        finally:
            self.out.put(("ended", pod))

    def _start_if_wanted(self, pod: Mapping[str, Any]) -> None:
        """A stream for a pod of a wanted node, once it has started and if not streamed yet."""
        metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
        index = _pod_index(self.name, metadata.get("name", ""))
        if (index in self.wanted and metadata.get("uid") not in self.followed
                and status.get("phase") not in (None, "Pending")):
            self.followed.add(metadata["uid"])
            attempt = (metadata.get("labels") or {}).get(ATTEMPT_LABEL, "?")
            self.out.put(("started", metadata["name"]))
            threading.Thread(target=self._stream_pod, args=(metadata["name"], index, attempt),
                             daemon=True).start()

    def _watch_pods(self) -> None:
        try:
            for pod in self.reader._watch(self.reader.requests.core.list_namespaced_pod, "pods",
                                          label_selector=f"{JOB_NAME_LABEL}={self.name}"):
                if pod is None:
                    self.pods_listed.set()
                else:
                    self._start_if_wanted(pod)
        except AccelerateJobError as error:
            self.out.put(("error", error))

    def _watch_job(self) -> None:
        try:
            for body in self.reader._watch(
                    self.reader.requests.custom.list_namespaced_custom_object, "AccelerateJobs",
                    GROUP, VERSION, PLURAL, field_selector=f"metadata.name={self.name}"):
                if body is not None and (
                        (body.get("status") or {}).get("phase") in FINISHED_PHASES):
                    # the pods that exist now have had their streams started first
                    self.pods_listed.wait()
                    self.out.put(("finished", None))
                    return
        except AccelerateJobError as error:
            self.out.put(("error", error))


def _pod_index(job_name: str, pod: str) -> int:
    """The node index of pod `<job>-<i>`, or -1 for a pod of another name."""
    suffix = pod[len(job_name) + 1:] if pod.startswith(f"{job_name}-") else ""
    return int(suffix) if suffix.isdigit() else -1
