"""The client's one request layer: a connection of its own to one cluster, and `call`, which
runs one API call and turns every failure into an AccelerateJobError that says what to do.

Every client holds its own ApiClient (the kubernetes package's global configuration is left
alone, so two clients may talk to two clusters). The only module of accelerate_job that knows
about ApiException, HTTP statuses and transport errors."""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes
import kubernetes.watch
import urllib3
import yaml
from accelerate_operator.apierrors import server_message
from kubernetes.client.rest import ApiException

from .errors import AccelerateJobError


class WatchExpired(Exception):
    """The watch's resourceVersion is too old (410 Gone): read the object again, then watch."""


class WatchDropped(AccelerateJobError):
    """A watch's connection failed or broke (or the server answered 429 or 5xx); `connected`:
    whether the server had answered first. Requests.follow watches again."""

    def __init__(self, message: str, connected: bool):
        super().__init__(message)
        self.connected = connected


# How long the API server holds one watch open before the client starts the next one from the
# last resourceVersion (the server's own default is 30-60 minutes; a shorter one survives
# idle-connection reaping by proxies).
WATCH_SECONDS = 300
# After a dropped watch, the next one waits as kubectl's retry watcher does: 0.8 s, doubling,
# at most 30 s; once the server has not answered for UNREACHABLE_SECONDS, the error is raised.
RETRY_FIRST_SECONDS, RETRY_MOST_SECONDS, UNREACHABLE_SECONDS = 0.8, 30.0, 120.0
RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504})


class Cancel:
    """Ends watches from another thread at once: set() shuts down every response they hold
    open, which wakes the read blocked on it (a thread left blocked in a TLS read at
    interpreter exit aborts the process)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._open: set[Any] = set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep `seconds`, or less when set meanwhile."""
        return self._event.wait(seconds)

    def set(self) -> None:
        self._event.set()
        with self._lock:
            responses = list(self._open)
        for response in responses:
            _shutdown(response)

    def hold(self, response: Any) -> None:
        with self._lock:
            self._open.add(response)
        if self.is_set():
            _shutdown(response)

    def release(self, response: Any) -> None:
        with self._lock:
            self._open.discard(response)


def _shutdown(response: Any) -> None:
    try:
        (getattr(response, "shutdown", None) or response.close)()
    except Exception:  # already closed, or closing under a reader: it stops either way
        pass


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else deadline - time.monotonic()

IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class Connection:
    api_client: kubernetes.client.ApiClient
    namespace: str  # the chosen context's, else the pod's, else "default"


def connect(kubeconfig: str | None = None, context: str | None = None) -> Connection:
    """A connection from a kubeconfig ($KUBECONFIG, else ~/.kube/config) and context (default:
    its current one); in a pod without a kubeconfig, the pod's service account."""
    configuration = kubernetes.client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())
    have_file = any(Path(p).expanduser().exists() for p in path.split(os.pathsep) if p)
    if not have_file and not kubeconfig and not context and IN_CLUSTER_NAMESPACE.exists():
        kubernetes.config.load_incluster_config(client_configuration=configuration)
        return Connection(kubernetes.client.ApiClient(configuration),
                          IN_CLUSTER_NAMESPACE.read_text().strip())
    if not have_file:
        raise AccelerateJobError(
            f"no kubeconfig at {path}; set KUBECONFIG or pass --kubeconfig (kubeconfig=)")
    try:
        kubernetes.config.load_kube_config(config_file=path, context=context,
                                           client_configuration=configuration,
                                           persist_config=False)
        contexts, active = kubernetes.config.list_kube_config_contexts(path)
    except (kubernetes.config.ConfigException, yaml.YAMLError, OSError, ValueError, TypeError,
            AttributeError, KeyError) as error:
        raise AccelerateJobError(
            f"cannot use kubeconfig {path}: {_config_problem(error)}; check the file, or pick a "
            "context with --context") from None
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
    namespace = ((chosen or {}).get("context") or {}).get("namespace") or "default"
    return Connection(kubernetes.client.ApiClient(configuration), namespace)


def _config_problem(error: Exception) -> str:
    """What is wrong with a kubeconfig, in one line: the loader's message, the file's own
    error (a directory, unreadable, not UTF-8, not YAML), or, for YAML the loader cannot
    walk (a list, a number), what a kubeconfig is."""
    if isinstance(error, (TypeError, AttributeError, KeyError)):
        return "it is not a kubeconfig (a YAML mapping of clusters, users and contexts)"
    if isinstance(error, OSError):
        return error.strerror or str(error)
    return " ".join(str(error).split())


def context_namespace(kubeconfig: str | None, context: str | None) -> str:
    """The namespace a kubeconfig context names, else "default" (also when there is no usable
    kubeconfig: what needs no cluster still works)."""
    try:
        return connect(kubeconfig, context).namespace
    except Exception:  # no kubeconfig, or a broken one
        return "default"


class Requests:
    """The API groups the client uses, over one connection, and the one way to call them."""

    def __init__(self, api_client: kubernetes.client.ApiClient, namespace: str):
        self.api_client = api_client
        self.namespace = namespace
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.custom = kubernetes.client.CustomObjectsApi(api_client)

    def call(self, what: str, fn: Callable[..., Any], *args: Any,
             answers: Mapping[int, Any] | None = None,
             errors: Mapping[int, Exception | Callable[[str], Exception]] | None = None,
             failure: str | None = None, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`, to `what` (for messages: "read AccelerateJob x"). A status in
        `answers` is an answer (its value is returned), one in `errors` raises that error;
        any other failure raises an AccelerateJobError ("cannot <what>: <server's message>",
        or `failure` instead of "cannot <what>")."""
        try:
            return fn(*args, **kwargs)
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as error:
            return self._failed(error, what, answers, errors, failure)

    def watch(self, what: str, fn: Callable[..., Any], *args: Any,
              errors: Mapping[int, Exception | Callable[[str], Exception]] | None = None,
              cancel: Cancel | None = None, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        """The events of one watch (`fn` a list call; with `follow=True`, a log read: then each
        event is ("LINE", text)) as (type, object as a dict), until the server ends it (pass
        `timeout_seconds`) or `cancel` is set. Raises WatchExpired on 410 Gone, WatchDropped
        when the connection fails or breaks, else as `call` does."""
        watch, cancel, opened = kubernetes.watch.Watch(), cancel or Cancel(), []

        @functools.wraps(fn)  # Watch reads the call's docstring: its return type, follow
        def opening(*args: Any, **kwargs: Any) -> Any:
            opened.append(fn(*args, **kwargs))
            cancel.hold(opened[-1])
            return opened[-1]

        try:
            for event in watch.stream(opening, *args, **kwargs):
                yield ("LINE", event) if isinstance(event, str) else (event["type"],
                                                                     event["raw_object"])
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as error:
            if not cancel.is_set():
                self._watch_failed(error, what, errors, connected=bool(opened))
        finally:
            watch.stop()
            for response in opened:
                cancel.release(response)

    def _watch_failed(self, error: Exception, what: str,
                      errors: Mapping[int, Exception | Callable[[str], Exception]] | None,
                      connected: bool) -> None:
        status = getattr(error, "status", None) if isinstance(error, ApiException) else None
        if status == 410:
            raise WatchExpired(str(error.reason)) from None
        if isinstance(error, ApiException) and status not in RETRIED_STATUSES:
            self._failed(error, what, None, errors, None)
        try:
            self._failed(error, what, None, None, None)
        except AccelerateJobError as failure:
            raise WatchDropped(str(failure), connected and status is None) from None

    def follow(self, what: str, fn: Callable[..., Any], *args: Any, version: str | None,
               deadline: float | None = None, cancel: Cancel | None = None,
               **kwargs: Any) -> Iterator[tuple[str, Any]]:
        """The events after resourceVersion `version`, watch after watch, until `deadline`
        (time.monotonic(); None: for as long as the caller iterates) or `cancel`. As kubectl's
        retry watcher, a watch that ends or drops is started again from the last version seen;
        after a drop with a backoff, raising the error once the server has not answered for
        UNREACHABLE_SECONDS. Raises WatchExpired on 410 Gone: list again, then follow."""
        cancel, delay, failing_since = cancel or Cancel(), RETRY_FIRST_SECONDS, None
        dropped: WatchDropped | None = None
        while not cancel.is_set():
            left = _left(deadline)
            if left is not None and left <= 0:
                if dropped is not None and not dropped.connected:  # on an unreachable server
                    raise dropped
                return
            seconds = WATCH_SECONDS if left is None else max(1, min(WATCH_SECONDS,
                                                                    math.ceil(left)))
            try:
                for kind, body in self.watch(what, fn, *args, resource_version=version,
                                             timeout_seconds=seconds, cancel=cancel,
                                             allow_watch_bookmarks=True, **kwargs):
                    version = (body.get("metadata") or {}).get("resourceVersion") or version
                    yield kind, body
                    if (left := _left(deadline)) is not None and left <= 0:
                        return
                dropped = None
            except WatchDropped as error:
                if error.connected:  # it had answered: this is a new failure
                    delay, failing_since = RETRY_FIRST_SECONDS, None
                dropped, failing_since = error, failing_since or time.monotonic()
                if time.monotonic() - failing_since >= UNREACHABLE_SECONDS:
                    raise
                cancel.wait(delay if left is None else min(delay, max(0.0, left)))
                delay = min(delay * 2, RETRY_MOST_SECONDS)

    def _failed(self, error: Exception, what: str, answers: Mapping[int, Any] | None,
                errors: Mapping[int, Exception | Callable[[str], Exception]] | None,
                failure: str | None) -> Any:
        if isinstance(error, ApiException):
            if answers and error.status in answers:
                return answers[error.status]
            if errors and error.status in errors:
                found = errors[error.status]
                if not isinstance(found, BaseException):
                    found = found(server_message(error))
                raise found from None
            if error.status in (401, 403):
                raise AccelerateJobError(
                    f"not allowed to {what}: {server_message(error)}; check your kubeconfig "
                    "context, or ask a cluster admin for access to acceleratejobs in namespace "
                    f"{self.namespace}") from None
            raise AccelerateJobError(
                f"{failure or f'cannot {what}'}: {server_message(error)}") from None
        host = self.api_client.configuration.host  # refused, timed out, DNS
        raise AccelerateJobError(
            f"cannot reach the Kubernetes API server at {host} to {what} ({error}); is the "
            "cluster up and is your kubeconfig's current context the right one?") from None
