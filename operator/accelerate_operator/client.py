"""`AccelerateJobClient`: submit, watch and read AccelerateJobs from Python (a notebook, a script,
the `accelerate-job` CLI).

The user-side counterpart of kube.py: the only module of the client that talks to the API server.
Every client holds its own API connection (no global kubernetes configuration, so two clients
may talk to two clusters), prints nothing, and raises `AccelerateJobError` subclasses whose
message says what is wrong and what to do; the CLI prints exactly that message."""

from __future__ import annotations

import copy
import json
import os
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes
import urllib3
from accelerate_trainer.config import ConfigError
from kubernetes.client.rest import ApiException

from .constants import (
    ATTEMPT_LABEL,
    FAILED,
    FINISHED_PHASES,
    GROUP,
    JOB_NAME_LABEL,
    PLURAL,
    SUCCEEDED,
    VERSION,
)
from .naming import logs_configmap_name, pod_name
from .resources.logs import logs_key
from .submission import build_config_source, check_accelerate_yaml, use_config_source

IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
CONDITIONS = ("Created", "Running", "Restarting", "Suspended", "Succeeded", "Failed")
LIST_HINT = "list them with `accelerate-job list`"


class AccelerateJobError(Exception):
    """An expected failure: the message says what is wrong and what to do."""


class JobNotFound(AccelerateJobError):
    pass


class JobFailed(AccelerateJobError):
    """The job reached Failed while waiting for another condition."""

    def __init__(self, message: str, job: Mapping[str, Any]):
        super().__init__(message)
        self.job = job


class WaitTimeout(AccelerateJobError, TimeoutError):
    pass


def _server_message(error: ApiException) -> str:
    try:
        return json.loads(error.body).get("message") or error.reason
    except (TypeError, ValueError, AttributeError):
        return str(error.reason or error)


def _condition(job: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") == type_ and condition.get("status") == "True":
            return condition
    return None


def prefix_lines(text: str, node: int) -> str:
    return "".join(f"[node {node}] {line}" for line in text.splitlines(keepends=True))


class AccelerateJobClient:
    """AccelerateJobs in one namespace of one cluster.

    `kubeconfig` and `context` default to $KUBECONFIG (else ~/.kube/config) and its current
    context; in a pod without a kubeconfig, the pod's service account. `namespace` defaults to
    the context's namespace, else `default`."""

    def __init__(self, kubeconfig: str | None = None, context: str | None = None,
                 namespace: str | None = None, *,
                 api_client: kubernetes.client.ApiClient | None = None):
        default_namespace = "default"
        if api_client is None:
            api_client, default_namespace = _connect(kubeconfig, context)
        self.namespace = namespace or default_namespace
        self.api_client = api_client
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.custom = kubernetes.client.CustomObjectsApi(api_client)

    # ---- errors ---------------------------------------------------------------------------

    def _call(self, what: str, fn, *args: Any, **kwargs: Any) -> Any:
        """Run one API call; turn transport and authorization errors into messages."""
        try:
            return fn(*args, **kwargs)
        except ApiException as error:
            if error.status in (401, 403):
                raise AccelerateJobError(
                    f"not allowed to {what}: {_server_message(error)}; check your kubeconfig "
                    "context, or ask a cluster admin for access to acceleratejobs in namespace "
                    f"{self.namespace}") from None
            raise
        except (urllib3.exceptions.HTTPError, OSError) as error:  # refused, timed out, DNS
            host = self.api_client.configuration.host
            raise AccelerateJobError(
                f"cannot reach the Kubernetes API server at {host} to {what} ({error}); is the "
                "cluster up and is your kubeconfig's current context the right one?") from None

    def _not_found(self, name: str) -> JobNotFound:
        return JobNotFound(f"no AccelerateJob {name} in namespace {self.namespace}; {LIST_HINT}")

    # ---- jobs -----------------------------------------------------------------------------

    def get(self, name: str) -> dict[str, Any]:
        try:
            return self._call(f"read AccelerateJob {name}",
                              self.custom.get_namespaced_custom_object,
                              GROUP, VERSION, self.namespace, PLURAL, name)
        except ApiException as error:
            if error.status == 404:
                raise self._not_found(name) from None
            raise AccelerateJobError(
                f"cannot read AccelerateJob {name}: {_server_message(error)}") from None

    def list(self) -> list[dict[str, Any]]:
        try:
            result = self._call("list AccelerateJobs", self.custom.list_namespaced_custom_object,
                                GROUP, VERSION, self.namespace, PLURAL)
        except ApiException as error:
            if error.status == 404:
                raise AccelerateJobError(
                    "the AccelerateJob CRD is not installed in this cluster; install the operator "
                    "with its Helm chart (charts/accelerate-operator)") from None
            raise AccelerateJobError(
                f"cannot list AccelerateJobs: {_server_message(error)}") from None
        return sorted(result.get("items") or [], key=lambda job: job["metadata"]["name"])

    def progress(self, name: str) -> dict[str, Any] | None:
        """status.progress (step, totalSteps, loss, eta...), or None before rank 0 reports."""
        return (self.get(name).get("status") or {}).get("progress")

    def delete(self, name: str) -> None:
        """Delete the job; its pods, Service and ConfigMaps go with it (owner references)."""
        try:
            self._call(f"delete AccelerateJob {name}", self.custom.delete_namespaced_custom_object,
                       GROUP, VERSION, self.namespace, PLURAL, name,
                       propagation_policy="Background")
        except ApiException as error:
            if error.status == 404:
                raise self._not_found(name) from None
            raise AccelerateJobError(
                f"cannot delete AccelerateJob {name}: {_server_message(error)}") from None

    def submit(self, job: Any, config_yaml: str | None = None, *,
               config_files: Mapping[str, str] | None = None,
               dry_run: bool = False) -> dict[str, Any]:
        """Create an AccelerateJob from a dict (or anything with `.build()` returning one).

        With `config_yaml` (the text `accelerate config` writes), it is stored in a ConfigMap the
        job reads through spec.accelerateConfigFrom (its own, else `<name>-accelerate-yaml`),
        owned by the job. The server validates strictly: an unknown field is an error.
        `dry_run` has the server check everything and persist nothing. Returns the job."""
        body = copy.deepcopy(job.build() if hasattr(job, "build") else dict(job))
        metadata = body.setdefault("metadata", {})
        name = metadata.get("name")
        if not name:
            raise AccelerateJobError("the job has no metadata.name; give it one")
        metadata["namespace"] = metadata.get("namespace") or self.namespace
        if metadata["namespace"] != self.namespace:
            raise AccelerateJobError(
                f"the job's metadata.namespace is {metadata['namespace']} but this client works in "
                f"{self.namespace}; make them agree (AccelerateJobClient(namespace=...))")
        configmap = None
        if config_yaml is not None:
            try:
                check_accelerate_yaml(config_yaml, body.get("spec") or {}, config_files)
            except ConfigError as error:
                raise AccelerateJobError(str(error)) from None
            body, cm_name, key = use_config_source(body)
            configmap = build_config_source(name, self.namespace, config_yaml, cm_name, key,
                                            config_files)
        dry = "All" if dry_run else None
        try:
            self._call(f"read AccelerateJob {name}", self.custom.get_namespaced_custom_object,
                       GROUP, VERSION, self.namespace, PLURAL, name)
            raise AccelerateJobError(
                f"AccelerateJob {name} already exists in namespace {self.namespace}; delete it "
                f"with `accelerate-job delete {name}`, or pick another name")
        except ApiException as error:
            if error.status != 404:
                raise AccelerateJobError(
                    f"cannot submit {name}: {_server_message(error)}") from None
        created_configmap = configmap is not None and self._put_configmap(configmap, dry)
        try:
            created = self._call(
                f"create AccelerateJob {name}", self.custom.create_namespaced_custom_object,
                GROUP, VERSION, self.namespace, PLURAL, body, field_validation="Strict",
                dry_run=dry)
        except ApiException as error:
            if created_configmap and not dry_run:
                self._delete_configmap(configmap["metadata"]["name"])
            raise AccelerateJobError(
                f"the API server rejected AccelerateJob {name}: {_server_message(error)}") from None
        if configmap is not None and not dry_run:
            self._adopt_configmap(configmap["metadata"]["name"], created)
        return created

    def _put_configmap(self, configmap: dict[str, Any], dry: str | None) -> bool:
        """Create the config ConfigMap, or replace a leftover of the same name. Returns whether
        it was created (rather than replaced)."""
        name = configmap["metadata"]["name"]
        try:
            self._call(f"create ConfigMap {name}", self.core.create_namespaced_config_map,
                       self.namespace, configmap, dry_run=dry)
            return True
        except ApiException as error:
            if error.status != 409:
                raise AccelerateJobError(
                    f"cannot create ConfigMap {name}: {_server_message(error)}") from None
        try:
            self._call(f"replace ConfigMap {name}", self.core.replace_namespaced_config_map,
                       name, self.namespace, configmap, dry_run=dry)
        except ApiException as error:
            raise AccelerateJobError(
                f"cannot replace ConfigMap {name}: {_server_message(error)}") from None
        return False

    def _delete_configmap(self, name: str) -> None:
        try:
            self.core.delete_namespaced_config_map(name, self.namespace)
        except (ApiException, urllib3.exceptions.HTTPError, OSError):
            pass  # a leftover ConfigMap is harmless: the next submit replaces it

    def _adopt_configmap(self, name: str, job: Mapping[str, Any]) -> None:
        """Owned by the job, the ConfigMap is deleted with it. Best effort: a user allowed to
        create but not patch ConfigMaps still gets the job."""
        owner = {"apiVersion": job["apiVersion"], "kind": job["kind"],
                 "name": job["metadata"]["name"], "uid": job["metadata"]["uid"]}
        try:
            self.core.patch_namespaced_config_map(
                name, self.namespace, {"metadata": {"ownerReferences": [owner]}})
        except (ApiException, urllib3.exceptions.HTTPError, OSError):
            pass

    def wait(self, name: str, condition: str = SUCCEEDED, timeout: float = 3600,
             poll_interval: float = 2.0) -> dict[str, Any]:
        """Block until the job's `condition` is True; returns the job. Raises JobFailed when the
        job fails first, WaitTimeout after `timeout` seconds."""
        if condition not in CONDITIONS:
            raise AccelerateJobError(
                f"unknown condition {condition!r}; an AccelerateJob has the conditions "
                f"{', '.join(CONDITIONS)}")
        deadline = time.monotonic() + timeout
        while True:
            job = self.get(name)
            if _condition(job, condition):
                return job
            status = job.get("status") or {}
            failed = _condition(job, FAILED)
            if failed:
                raise JobFailed(
                    f"AccelerateJob {name} failed ({failed.get('reason')}): "
                    f"{failed.get('message')}; see `accelerate-job logs {name} --all`", job)
            if status.get("phase") in FINISHED_PHASES:
                raise AccelerateJobError(
                    f"AccelerateJob {name} is {status['phase']} and will never be {condition}")
            if time.monotonic() >= deadline:
                summary = ((status.get("progress") or {}).get("summary"))
                at = f" at {summary}" if summary else ""
                raise WaitTimeout(
                    f"AccelerateJob {name} is still {status.get('phase') or 'Pending'}{at} after "
                    f"{timeout:g}s of waiting for {condition}; wait longer with --timeout, or "
                    f"look at `accelerate-job status {name}`")
            time.sleep(min(poll_interval, max(deadline - time.monotonic(), 0.05)))

    # ---- logs -----------------------------------------------------------------------------

    def logs(self, name: str, node: int | str = 0, follow: bool = False,
             attempt: int | None = None, tail_lines: int | None = None) -> str | Iterator[str]:
        """The log of node `node` (an index, or "all": every line prefixed `[node N] `).

        `attempt` reads the log the operator archived when it restarted the group after that
        attempt (its last lines). `follow` returns an iterator of lines instead of the text,
        following the pods through restarts until the job finishes."""
        job = self.get(name)
        nodes = self._nodes(job, node)
        if attempt is not None:
            if follow:
                raise AccelerateJobError("--follow and --attempt do not mix: an archived log is "
                                         "complete; drop --follow")
            return self._archived_logs(job, nodes, node == "all", attempt)
        if follow:
            return self._follow(job, nodes, node == "all")
        texts = []
        for index in nodes:
            text = self._pod_log(job, index, tail_lines)
            texts.append(prefix_lines(text, index) if node == "all" else text)
        return "".join(texts)

    def _nodes(self, job: Mapping[str, Any], node: int | str) -> list[int]:
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

    def _pod_log(self, job: Mapping[str, Any], index: int, tail_lines: int | None) -> str:
        name = job["metadata"]["name"]
        pod = pod_name(name, index)
        try:
            return self._call(f"read the log of pod {pod}", self.core.read_namespaced_pod_log,
                              pod, self.namespace, container=_trainer_container(job),
                              tail_lines=tail_lines) or ""
        except ApiException as error:
            phase = (job.get("status") or {}).get("phase") or "Pending"
            if error.status == 404:
                raise AccelerateJobError(
                    f"pod {pod} of AccelerateJob {name} does not exist (the job is {phase}); "
                    + ("its pods were cleaned up" if phase in FINISHED_PHASES
                       else "it is being created: try again, or use --follow")
                    + self._archive_hint(job)) from None
            if error.status == 400:
                raise AccelerateJobError(
                    f"pod {pod} has not started yet ({_server_message(error)}); try again, or "
                    "use --follow to wait for it") from None
            raise AccelerateJobError(
                f"cannot read the log of pod {pod}: {_server_message(error)}") from None

    def archived_attempts(self, name: str) -> list[int]:
        """The attempts whose logs the operator archived before restarting the group."""
        try:
            result = self._call("list ConfigMaps", self.core.list_namespaced_config_map,
                                self.namespace,
                                label_selector=f"{JOB_NAME_LABEL}={name},{ATTEMPT_LABEL}")
        except ApiException as error:
            raise AccelerateJobError(
                f"cannot list the archived logs of {name}: {_server_message(error)}") from None
        attempts = []
        for item in result.items:
            label = (item.metadata.labels or {}).get(ATTEMPT_LABEL, "")
            if label.isdigit() and item.metadata.name == logs_configmap_name(name, int(label)):
                attempts.append(int(label))
        return sorted(attempts)

    def _archive_hint(self, job: Mapping[str, Any]) -> str:
        restarts = int((job.get("status") or {}).get("restarts") or 0)
        if not restarts:
            return ""
        return (f"; logs of earlier attempts: `accelerate-job logs {job['metadata']['name']} "
                "--attempt N`")

    def _archived_logs(self, job: Mapping[str, Any], nodes: list[int], prefix: bool,
                       attempt: int) -> str:
        name = job["metadata"]["name"]
        cm_name = logs_configmap_name(name, attempt)
        try:
            configmap = self._call(f"read ConfigMap {cm_name}",
                                   self.core.read_namespaced_config_map, cm_name, self.namespace)
        except ApiException as error:
            if error.status != 404:
                raise AccelerateJobError(
                    f"cannot read ConfigMap {cm_name}: {_server_message(error)}") from None
            archived = self.archived_attempts(name)
            current = (job.get("status") or {}).get("attempt", 0)
            raise AccelerateJobError(
                f"no archived logs for attempt {attempt} of AccelerateJob {name} (archived: "
                f"{', '.join(map(str, archived)) or 'none'}); the operator archives a group's logs "
                f"when it restarts it, and the current attempt ({current}) is read without "
                "--attempt") from None
        data = configmap.data or {}
        texts = []
        for index in nodes:
            text = data.get(logs_key(pod_name(name, index)), "")
            texts.append(prefix_lines(text, index) if prefix else text)
        return "".join(texts)

    def _follow(self, job: Mapping[str, Any], nodes: list[int], prefix: bool) -> Iterator[str]:
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

        threads = [threading.Thread(target=pump, args=(i,), daemon=True) for i in nodes]
        for thread in threads:
            thread.start()
        running = len(threads)
        try:
            while running:
                index, line = out.get()
                if line is None:
                    running -= 1
                else:
                    yield f"[node {index}] {line}"
        finally:
            stop.set()

    def _follow_pod(self, job: Mapping[str, Any], index: int,
                    stop: threading.Event | None = None) -> Iterator[str]:
        """Stream pod `<job>-<index>`'s log; when the pod ends, follow its replacement (the next
        attempt) until the job finishes."""
        name = job["metadata"]["name"]
        pod = pod_name(name, index)
        container = _trainer_container(job)
        streamed: set[str] = set()
        while not (stop and stop.is_set()):
            try:
                current = self._call(f"read pod {pod}", self.core.read_namespaced_pod,
                                     pod, self.namespace)
            except ApiException as error:
                if error.status != 404:
                    raise AccelerateJobError(f"cannot read pod {pod}: {_server_message(error)}") \
                        from None
                current = None
            started = current is not None and current.status.phase != "Pending"
            if started and current.metadata.uid not in streamed:
                if streamed:
                    attempt = (current.metadata.labels or {}).get(ATTEMPT_LABEL, "?")
                    yield f"--- {pod} restarted (attempt {attempt}) ---"
                streamed.add(current.metadata.uid)
                yield from self._stream(pod, container, stop)
                continue
            phase = ((self.get(name).get("status")) or {}).get("phase")
            if phase in FINISHED_PHASES:
                return
            time.sleep(1.0)

    def _stream(self, pod: str, container: str | None,
                stop: threading.Event | None) -> Iterator[str]:
        try:
            response = self._call(f"follow the log of pod {pod}", self.core.read_namespaced_pod_log,
                                  pod, self.namespace, container=container, follow=True,
                                  _preload_content=False)
        except ApiException as error:
            if error.status in (400, 404):  # gone or not started: the caller looks again
                return
            raise AccelerateJobError(
                f"cannot follow the log of pod {pod}: {_server_message(error)}") from None
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


def _trainer_container(job: Mapping[str, Any]) -> str | None:
    containers = (((job.get("spec") or {}).get("template") or {}).get("spec") or {}).get(
        "containers") or [{}]
    return containers[0].get("name")


def _connect(kubeconfig: str | None,
             context: str | None) -> tuple[kubernetes.client.ApiClient, str]:
    """An ApiClient of its own (the kubernetes package's global configuration is left alone)
    and the namespace of the chosen context."""
    configuration = kubernetes.client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())
    have_file = any(Path(p).expanduser().exists() for p in path.split(os.pathsep) if p)
    if not have_file and not kubeconfig and not context and IN_CLUSTER_NAMESPACE.exists():
        kubernetes.config.load_incluster_config(client_configuration=configuration)
        return kubernetes.client.ApiClient(configuration), IN_CLUSTER_NAMESPACE.read_text().strip()
    if not have_file:
        raise AccelerateJobError(
            f"no kubeconfig at {path}; set KUBECONFIG or pass --kubeconfig (kubeconfig=)")
    try:
        kubernetes.config.load_kube_config(config_file=path, context=context,
                                           client_configuration=configuration,
                                           persist_config=False)
        contexts, active = kubernetes.config.list_kube_config_contexts(path)
    except kubernetes.config.ConfigException as error:
        raise AccelerateJobError(
            f"cannot use kubeconfig {path}: {error}; check the file, or pick a context with "
            "--context") from None
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
    namespace = ((chosen or {}).get("context") or {}).get("namespace") or "default"
    return kubernetes.client.ApiClient(configuration), namespace
