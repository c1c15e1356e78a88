"""Reading a job's logs for AccelerateJobClient: the live log of a node or of all of them, the
last lines the operator archived when it restarted the group, and following the pods through
restarts with watches and follow streams (no polling). Every call goes through the request
layer (request.py)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from accelerate_operator.constants import FINISHED_PHASES, GROUP, PLURAL, VERSION
from accelerate_operator.naming import logs_configmap_name, pod_name, trainer_container_name
from accelerate_operator.resources.logs import logs_key
from accelerate_trainer.contract import ATTEMPT_LABEL, JOB_NAME_LABEL

from .errors import AccelerateJobError
from .render import node_count
from .request import Cancel, Requests, WatchExpired

Job = Mapping[str, Any]
# How long a follower that ends waits for its threads to stop (each is woken at once).
STOP_SECONDS = 5.0


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
        all_lines = tail_lines is not None and tail_lines < 0  # kubectl's --tail=-1
        live = LiveLog(container or _container(job), None if all_lines else tail_lines,
                       since_seconds)
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
        return self.requests.call(
            f"read the log of pod {pod}", self.requests.core.read_namespaced_pod_log, pod,
            self.namespace, container=live.container, tail_lines=live.tail_lines,
            since_seconds=live.since_seconds,
            errors={404: missing, 400: lambda message: _unreadable(pod, message)}) or ""

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

    def _watch(self, list_fn: Callable[..., Any], what: str, *args: Any, cancel: Cancel,
               **selectors: Any) -> Iterator[dict[str, Any] | None]:
        """Every object a namespaced list call returns (its current state), then None, then
        every one that is added or changes, until `cancel`; lists again on 410."""
        namespaced = (*args[:2], self.namespace, *args[2:]) if args else (self.namespace,)
        while not cancel.is_set():
            result = self.requests.call(f"list {what}", list_fn, *namespaced, **selectors)
            items = result.get("items") if isinstance(result, dict) else [
                self.requests.api_client.sanitize_for_serialization(item)
                for item in result.items]
            metadata = result.get("metadata") if isinstance(result, dict) else {
                "resourceVersion": result.metadata.resource_version}
            yield from items or []
            yield None  # the listed state is complete
            try:
                for kind, body in self.requests.follow(
                        f"watch {what}", list_fn, *namespaced, cancel=cancel,
                        version=(metadata or {}).get("resourceVersion"), **selectors):
                    if kind in ("ADDED", "MODIFIED"):
                        yield body
            except WatchExpired:
                continue

    def _stream(self, pod: str, live: LiveLog, cancel: Cancel) -> Iterator[str]:
        """The pod's log, following it until its container ends (a follow stream) or
        `cancel`. Raises PodGone when the pod is no more (a restart replaced it)."""
        lines = self.requests.watch(
            f"follow the log of pod {pod}", self.requests.core.read_namespaced_pod_log, pod,
            self.namespace, container=live.container, follow=True, cancel=cancel,
            tail_lines=live.tail_lines, since_seconds=live.since_seconds,
            errors={400: lambda message: _unreadable(pod, message), 404: PodGone(pod)})
        for _, line in lines:
            yield line


class PodGone(AccelerateJobError):
    """The pod whose log was to be followed was deleted first: its replacement is followed."""


def _unreadable(pod: str, message: str) -> AccelerateJobError:
    """What a 400 from a log read means: a container still waiting to start, else what the
    server says (a container the pod lacks, for -c)."""
    if "waiting to start" in message or "PodInitializing" in message:
        return AccelerateJobError(f"pod {pod} has not started yet ({message}); try again, or "
                                  "use --follow to wait for it")
    return AccelerateJobError(f"cannot read the log of pod {pod}: {message}")


class _Follower:
    """Follows a job's logs through restarts, never by polling: one watch on the job's pods (by
    label) starts a follow stream for each pod of a wanted node once it has started, the
    replacement of a later attempt included; one watch on the job says when it has finished. A
    stream blocks, so each runs in a thread of its own and its lines reach the caller through
    one queue, whichever pod they are from. Ends once the job has finished and every stream
    has ended, or at the first error (raised); either way, or when the caller stops reading,
    every watch and stream is stopped and its thread ended (none is left behind)."""

    def __init__(self, reader: LogReader, job: Job, nodes: list[int], prefix: bool,
                 live: LiveLog):
        self.reader, self.job, self.prefix, self.live = reader, job, prefix, live
        self.name = job["metadata"]["name"]
        self.wanted = set(nodes)
        self.out: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=10000)
        self.followed: set[str] = set()  # pod uids already streamed
        self.seen_node: set[int] = set()
        self.pods_listed = threading.Event()
        self.cancel = Cancel()
        self.threads: list[threading.Thread] = []

    def lines(self) -> Iterator[str]:
        for target in (self._watch_pods, self._watch_job):
            self._start(target)
        try:
            yield from self._read()
        finally:
            self._stop()

    def _read(self) -> Iterator[str]:
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

    def _start(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _stop(self) -> None:
        """Shut every watch and stream down and wait for their threads (emptying the queue,
        which a thread may be blocked on); one stuck opening a connection is left after
        STOP_SECONDS."""
        self.cancel.set()
        self.pods_listed.set()
        deadline = time.monotonic() + STOP_SECONDS
        for thread in self.threads:  # those started meanwhile too
            while thread.is_alive() and time.monotonic() < deadline:
                while not self.out.empty():
                    self.out.get_nowait()
                thread.join(0.05)

    def _stream_pod(self, pod: str, index: int, attempt: str, live: LiveLog,
                    restarted: bool) -> None:
        try:
            if restarted:
                self.out.put(("line", (index, f"--- {pod} restarted (attempt {attempt}) ---")))
            for line in self.reader._stream(pod, live, self.cancel):
                self.out.put(("line", (index, line)))
        except PodGone:
            pass  # deleted before its log was read: the pod watch follows its replacement
        except AccelerateJobError as error:
            self.out.put(("error", error))
        finally:
            self.out.put(("ended", pod))

    def _start_if_wanted(self, pod: Mapping[str, Any]) -> None:
        """A stream for a pod of a wanted node, once it has started and if not streamed yet;
        --tail applies to a node's first pod only (a replacement's log is new)."""
        metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
        index = _pod_index(self.name, metadata.get("name", ""))
        if (index in self.wanted and metadata.get("uid") not in self.followed
                and status.get("phase") not in (None, "Pending") and not self.cancel.is_set()):
            self.followed.add(metadata["uid"])
            attempt = (metadata.get("labels") or {}).get(ATTEMPT_LABEL, "?")
            restarted = index in self.seen_node
            self.seen_node.add(index)
            live = replace(self.live, tail_lines=None) if restarted else self.live
            self.out.put(("started", metadata["name"]))
            self._start(self._stream_pod, metadata["name"], index, attempt, live, restarted)

    def _watch_pods(self) -> None:
        try:
            for pod in self.reader._watch(self.reader.requests.core.list_namespaced_pod, "pods",
                                          cancel=self.cancel,
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
                    GROUP, VERSION, PLURAL, cancel=self.cancel,
                    field_selector=f"metadata.name={self.name}"):
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
