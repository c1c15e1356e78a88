"""`AccelerateJobClient`: submit, watch and read AccelerateJobs from Python (a notebook, a script,
the `accelerate-job` CLI).

Every call goes through the request layer (request.py), so the client prints nothing and raises
`AccelerateJobError` subclasses whose message says what is wrong and what to do. Reading logs is
logs.py's; building what submit creates is submission.py's."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from accelerate_operator.constants import (
    CONDITION_TYPES,
    FAILED,
    FINISHED_PHASES,
    GROUP,
    KIND,
    PLURAL,
    SUCCEEDED,
    VERSION,
)
from accelerate_trainer.config import ConfigError
from accelerate_trainer.contract import JOB_NAME_LABEL

from .code import CodeArchive
from .errors import AccelerateJobError, InvalidConfig, JobFailed, JobNotFound, WaitTimeout
from .logs import LogReader
from .render import printable
from .request import Requests, WatchExpired, connect
from .submission import build_submission, owned_by

if TYPE_CHECKING:
    import kubernetes

LIST_HINT = "list them with `accelerate-job get`"


def _job_key(job: Mapping[str, Any]) -> tuple[str, str]:
    """How jobs are sorted and told apart across namespaces."""
    metadata = job["metadata"]
    return metadata.get("namespace") or "", metadata["name"]


def true_condition(job: Mapping[str, Any], type_: str) -> Mapping[str, Any] | None:
    for condition in (job.get("status") or {}).get("conditions") or []:
        if condition.get("type") == type_ and condition.get("status") == "True":
            return condition
    return None


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
            connection = connect(kubeconfig, context)
            api_client, default_namespace = connection.api_client, connection.namespace
        self.namespace = namespace or default_namespace
        self.requests = Requests(api_client, self.namespace)
        self._logs = LogReader(self.requests, self.get)

    def _job_call(self, verb: str, name: str, fn, *args: Any, **kwargs: Any) -> Any:
        not_found = JobNotFound(f"no AccelerateJob {name} in namespace {self.namespace}; "
                                f"{LIST_HINT}")
        return self.requests.call(f"{verb} AccelerateJob {name}", fn, GROUP, VERSION,
                                  self.namespace, PLURAL, *args, errors={404: not_found},
                                  **kwargs)

    # ---- jobs -----------------------------------------------------------------------------

    def get(self, name: str) -> dict[str, Any]:
        """The job as the API server has it (spec and status); JobNotFound if there is none."""
        return self._job_call("read", name, self.requests.custom.get_namespaced_custom_object,
                              name)

    def list(self, all_namespaces: bool = False,
             selector: str | None = None) -> list[dict[str, Any]]:
        """The namespace's jobs sorted by name; with `all_namespaces`, every namespace's, sorted
        by namespace then name (`kubectl get -A`); `selector`: those a label selector picks."""
        missing_crd = AccelerateJobError(
            "the AccelerateJob CRD is not installed in this cluster; install the operator with "
            "its Helm chart (charts/accelerate-operator)")
        result = self.requests.call("list AccelerateJobs", *self._list_call(all_namespaces),
                                    errors={404: missing_crd}, label_selector=selector or None)
        return sorted(result.get("items") or [], key=_job_key)

    def _list_call(self, all_namespaces: bool) -> tuple[Any, ...]:
        """The list function and its arguments, for one namespace or all of them."""
        if all_namespaces:
            return self.requests.custom.list_cluster_custom_object, GROUP, VERSION, PLURAL
        return (self.requests.custom.list_namespaced_custom_object, GROUP, VERSION,
                self.namespace, PLURAL)

    def events(self, name: str) -> list[dict[str, Any]]:
        """The events about the job (the operator's Normal and Warning events), oldest first."""
        result = self.requests.call(
            f"list the events of AccelerateJob {name}",
            self.requests.core.list_namespaced_event, self.namespace,
            field_selector=f"involvedObject.name={name},involvedObject.kind={KIND}")
        events = self.requests.api_client.sanitize_for_serialization(result.items)
        return sorted(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")

    def pods(self, name: str) -> list[dict[str, Any]]:
        """The job's pods now (by the job-name label), sorted by name."""
        result = self.requests.call(
            f"list the pods of AccelerateJob {name}", self.requests.core.list_namespaced_pod,
            self.namespace, label_selector=f"{JOB_NAME_LABEL}={name}")
        pods = self.requests.api_client.sanitize_for_serialization(result.items)
        return sorted(pods, key=lambda pod: pod["metadata"]["name"])

    def progress(self, name: str) -> dict[str, Any] | None:
        """status.progress (step, totalSteps, loss, eta...), or None before rank 0 reports."""
        return (self.get(name).get("status") or {}).get("progress")

    def delete(self, name: str) -> None:
        """Delete the job; its pods, Service and ConfigMaps go with it (owner references)."""
        self._job_call("delete", name, self.requests.custom.delete_namespaced_custom_object,
                       name, propagation_policy="Background")

    def submit(self, job: Any, config_yaml: str | None = None, *,
               config_files: Mapping[str, str] | None = None,
               code: CodeArchive | None = None,
               dry_run: bool = False) -> dict[str, Any]:
        """Create an AccelerateJob from a dict (or anything with `.build()` returning one).

        With `config_yaml` (the text `accelerate config` writes), it is stored in a ConfigMap the
        job reads through spec.accelerateConfigFrom (its own, else `<name>-accelerate-yaml`),
        owned by the job; `config_files` (file name -> text, a DeepSpeed JSON the YAML names) go
        into that ConfigMap beside it. With `code` (`accelerate_job.pack_code("train.py",
        workdir=".")`), the packed code travels in the ConfigMap `<name>-code`, created owned by
        the job right after it (the job's spec.code names it); the trainer container's args
        name the script relative to /workspace (`code.entrypoint`). If that ConfigMap cannot be
        created the job is deleted again. The server validates strictly: an unknown field is an
        error. `dry_run` has the server check everything and persist nothing. Returns the job."""
        body, name = self._own(job)
        try:
            submission = build_submission(body, config_yaml, self.namespace, config_files, code)
        except ConfigError as error:
            raise InvalidConfig(str(error)) from None
        configmap = submission.config
        self._refuse_existing(name)
        dry = "All" if dry_run else None
        created = self._create_with_config(name, submission.job, configmap, dry)
        if configmap is not None and not dry_run:
            self._adopt_configmap(configmap["metadata"]["name"], created)
        if submission.code is not None:
            manifest = (owned_by(submission.code, created) if created["metadata"].get("uid")
                        else submission.code)
            self._ship_code(name, manifest, dry)
        return created

    def _create_with_config(self, name: str, body: dict[str, Any],
                            configmap: dict[str, Any] | None, dry: str | None) -> dict[str, Any]:
        """The config's ConfigMap, then the job; the ConfigMap is deleted again when the server
        refuses the job."""
        created_configmap = configmap is not None and self._put_configmap(configmap, dry)
        try:
            return self.requests.call(
                f"create AccelerateJob {name}",
                self.requests.custom.create_namespaced_custom_object,
                GROUP, VERSION, self.namespace, PLURAL, body, field_validation="Strict",
                dry_run=dry, failure=f"the API server rejected AccelerateJob {name}")
        except AccelerateJobError:
            if created_configmap and dry is None:
                self._delete_configmap(configmap["metadata"]["name"])
            raise

    def _ship_code(self, name: str, manifest: dict[str, Any], dry: str | None) -> None:
        """Create the code's ConfigMap, born owned by the created job: at no moment does it
        exist without an owner, so it is always garbage-collected with the job (also when the job
        is deleted before it is created: the collector removes dependents of a missing owner).
        Pods cannot start before it exists, and it is one object, written whole or not at all.
        A leftover of an earlier job of the same name (immutable) is replaced."""
        cm, core = manifest["metadata"]["name"], self.requests.core
        try:
            created = self.requests.call(
                f"create ConfigMap {cm}", core.create_namespaced_config_map, self.namespace,
                manifest, dry_run=dry, answers={409: False})
            if created is False:
                self.requests.call(f"delete ConfigMap {cm}", core.delete_namespaced_config_map,
                                   cm, self.namespace, dry_run=dry, answers={404: None})
                self.requests.call(f"create ConfigMap {cm}", core.create_namespaced_config_map,
                                   self.namespace, manifest, dry_run=dry)
        except AccelerateJobError as error:
            if not dry:
                self._delete_quietly(name)
            raise AccelerateJobError(
                f"could not ship the code of AccelerateJob {name}: {error}; the job was deleted "
                "again, so nothing runs without its code. Fix that and submit again") from None

    def _delete_quietly(self, name: str) -> None:
        try:
            self.delete(name)
        except AccelerateJobError:
            pass  # its pods wait for the code ConfigMap; `accelerate-job delete` removes it

    def _own(self, job: Any) -> tuple[dict[str, Any], str]:
        """A copy of the job, placed in this client's namespace, and its name."""
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
        return body, name

    def _refuse_existing(self, name: str) -> None:
        existing = self.requests.call(
            f"read AccelerateJob {name}", self.requests.custom.get_namespaced_custom_object,
            GROUP, VERSION, self.namespace, PLURAL, name, answers={404: None},
            failure=f"cannot submit {name}")
        if existing is not None:
            raise AccelerateJobError(
                f"AccelerateJob {name} already exists in namespace {self.namespace}; delete it "
                f"with `accelerate-job delete {name}`, or pick another name")

    def _put_configmap(self, configmap: dict[str, Any], dry: str | None) -> bool:
        """Create the config ConfigMap, or replace a leftover of the same name. Returns whether
        it was created (rather than replaced)."""
        name, core = configmap["metadata"]["name"], self.requests.core
        if self.requests.call(f"create ConfigMap {name}", core.create_namespaced_config_map,
                              self.namespace, configmap, dry_run=dry, answers={409: False}
                              ) is not False:
            return True
        self.requests.call(f"replace ConfigMap {name}", core.replace_namespaced_config_map,
                           name, self.namespace, configmap, dry_run=dry)
        return False

    def _delete_configmap(self, name: str) -> None:
        try:
            self.requests.call(f"delete ConfigMap {name}",
                               self.requests.core.delete_namespaced_config_map,
                               name, self.namespace)
        except AccelerateJobError:
            pass  # a leftover ConfigMap is harmless: the next submit replaces it

    def _adopt_configmap(self, name: str, job: Mapping[str, Any]) -> None:
        """Owned by the job, the ConfigMap is deleted with it. Best effort: a user allowed to
        create but not patch ConfigMaps still gets the job."""
        owner = {"apiVersion": job["apiVersion"], "kind": job["kind"],
                 "name": job["metadata"]["name"], "uid": job["metadata"]["uid"]}
        try:
            self.requests.call(f"patch ConfigMap {name}",
                               self.requests.core.patch_namespaced_config_map, name,
                               self.namespace, {"metadata": {"ownerReferences": [owner]}})
        except AccelerateJobError:
            pass

    def watch(self, name: str, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """The job now, then every new version of it as the API server sends it (a watch on
        this one object: nothing is polled; a dropped connection is watched again). Ends after
        `timeout` seconds (None: never, the caller stops iterating); raises JobNotFound when
        the job is deleted."""
        deadline = None if timeout is None else time.monotonic() + timeout
        job = self.get(name)
        yield job
        while True:
            try:
                for kind, body in self.requests.follow(
                        f"watch AccelerateJob {name}",
                        self.requests.custom.list_namespaced_custom_object, GROUP, VERSION,
                        self.namespace, PLURAL, field_selector=f"metadata.name={name}",
                        version=job["metadata"].get("resourceVersion"), deadline=deadline):
                    if kind == "DELETED":
                        raise JobNotFound(f"AccelerateJob {name} was deleted from namespace "
                                          f"{self.namespace}")
                    if kind in ("ADDED", "MODIFIED"):
                        yield body
                return
            except WatchExpired:  # the version is too old: read the job again, then watch
                job = self.get(name)
                yield job

    def watch_all(self, all_namespaces: bool = False) -> Iterator[list[dict[str, Any]]]:
        """Every job of the namespace (with `all_namespaces`, of every namespace), sorted as
        `list` sorts them: the list now, then again after each change the API server sends (one
        watch on the jobs, watched again when its connection drops)."""
        call = self._list_call(all_namespaces)
        while True:
            result = self.requests.call("list AccelerateJobs", *call)
            jobs = {_job_key(j): j for j in result.get("items") or []}
            yield [jobs[key] for key in sorted(jobs)]
            try:
                for kind, body in self.requests.follow(
                        "watch AccelerateJobs", *call,
                        version=(result.get("metadata") or {}).get("resourceVersion")):
                    if kind == "DELETED":
                        jobs.pop(_job_key(body), None)
                    elif kind in ("ADDED", "MODIFIED"):
                        jobs[_job_key(body)] = body
                    else:
                        continue
                    yield [jobs[key] for key in sorted(jobs)]
            except WatchExpired:
                continue  # list again

    def wait(self, name: str, condition: str = SUCCEEDED,
             timeout: float = 3600) -> dict[str, Any]:
        """Block until the job's `condition` is True; returns the job. Raises JobFailed when the
        job fails first, WaitTimeout after `timeout` seconds. Follows the job with a watch."""
        if condition not in CONDITION_TYPES:
            raise AccelerateJobError(
                f"unknown condition {condition!r}; an AccelerateJob has the conditions "
                f"{', '.join(CONDITION_TYPES)}")
        job: dict[str, Any] = {}
        for job in self.watch(name, timeout=timeout):
            if true_condition(job, condition):
                return job
            _never(job, name, condition)
        status = job.get("status") or {}
        summary = (status.get("progress") or {}).get("summary")
        at = f" at {summary}" if summary else ""
        raise WaitTimeout(printable(
            f"AccelerateJob {name} is still {status.get('phase') or 'Pending'}{at} after "
            f"{timeout:g}s of waiting for {condition}; wait longer with --timeout, or "
            f"look at `accelerate-job status {name}`"))

    # ---- logs -----------------------------------------------------------------------------

    def logs(self, name: str, node: int | str = 0, follow: bool = False,
             attempt: int | None = None, tail_lines: int | None = None, *,
             container: str | None = None,
             since_seconds: int | None = None) -> str | Iterator[str]:
        """The log of node `node` (an index, or "all": every line prefixed `[node N] `).

        `attempt` reads the log the operator archived when it restarted the group after that
        attempt (its last lines). `follow` returns an iterator of lines instead of the text,
        following the pods through restarts until the job finishes (an error raised; the
        watches and streams stopped once it ends or the caller stops reading). `container`
        (default: the trainer), `since_seconds` and `tail_lines` (-1: every line) are kubectl's
        -c, --since and --tail, for live logs; following, the tail is of each node's first
        pod."""
        return self._logs.logs(self.get(name), node, follow=follow, attempt=attempt,
                               tail_lines=tail_lines, container=container,
                               since_seconds=since_seconds)

    def archived_attempts(self, name: str) -> list[int]:
        """The attempts whose logs the operator archived before restarting the group."""
        return self._logs.archived_attempts(name)


def _never(job: Mapping[str, Any], name: str, condition: str) -> None:
    """Raise when the job finished without `condition`: waiting longer cannot help."""
    failed = true_condition(job, FAILED)
    if failed:
        raise JobFailed(
            printable(f"AccelerateJob {name} failed ({failed.get('reason')}): "
                      f"{failed.get('message')}; see `accelerate-job logs {name} --all`"), job)
    phase = (job.get("status") or {}).get("phase")
    if phase in FINISHED_PHASES:
        raise AccelerateJobError(
            printable(f"AccelerateJob {name} is {phase} and will never be {condition}"))
