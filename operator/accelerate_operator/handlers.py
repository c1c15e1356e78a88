"""The operator's kopf handlers: thin. kopf lists and watches the AccelerateJobs and what they
own (each owned kind filtered on the server by our job-name label), keeps what a pass reads of
each object in its indexes, and hands every event to the controller (controller.py), whose work
queue runs the job's pass.

- Indexes (`@kopf.index`): the jobs, their pods (as PodState), an elastic job's placeholder
  pods (on the same watch: they carry the job-name label), Services, rendered ConfigMaps,
  PodDisruptionBudgets and, with the Kueue integration, Workloads, each by (namespace, job
  name).
- Event handlers (`@kopf.on.event`): hand the event to the controller; kopf's `when=` filter is
  the controller's one rule of which events matter (event_filter.hands_over).
- Start-up: settings, and the controller started with the indexes, kept in kopf's operator
  memo (no state of this module's own); cleanup stops it; the probe answers kopf's liveness
  endpoint (`--liveness`).

Only event and index handlers: kopf writes nothing to a job (no finalizer, which would block
deleting jobs while the operator is down; no annotation, no diff-base) and posts no events of
its own; the operator's events are the only events. The one write kopf makes is its peering
keep-alive, when peering is on (the chart runs two replicas: one active, one paused)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import kopf

from . import metrics
from .constants import GROUP, PLURAL
from .controller import Controller
from .event_filter import hands_over
from .indexes import (
    configmap_entry,
    is_placeholder,
    job_entry,
    owning_job,
    pod_entry,
    workload_entry,
)
from .kube import OWNED, Kube
from .kueue import KUEUE_GROUP
from .peering import PeeringFollower
from .reconciler import Reconciler
from .report_keeper import CertKeeper
from .report_presence import Presence
from .report_server import ReportServer
from .report_settings import ReportSettings, read_report_settings
from .report_tokens import IssuerKeys

log = logging.getLogger("accelerate_operator")

KUEUE_ENABLED = os.environ.get("ACCELERATE_OPERATOR_KUEUE", "").lower() in ("1", "true")
# kopf's per-object worker exits this long after its last event and drops the body it holds
# (default 5 s: with 1,000 pods starting, 1,000 bodies held for nothing).
WORKER_IDLE_SECONDS = 0.5
# Initial lists in pages of this many objects (default: one response for all of them).
LIST_CHUNK = 500
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
REPORT_RETRY_SECONDS = 30.0


class NoDiffBase(kopf.DiffBaseStorage):
    """No diff-base: kopf builds one (a deep copy of the body) on every event for on.create/
    update/resume handlers, and this operator has none; so nothing is built or stored."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> kopf.BodyEssence:
        return {}

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return None

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def _login(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """Through the official client: in a pod, its service account at the API server's address
    (KUBERNETES_SERVICE_HOST/PORT, as client-go does: cluster DNS, which kopf's own service
    account login needs for kubernetes.default.svc, may be down with a lost node); elsewhere the
    kubeconfig (exec plugins, OIDC and token refresh included), else kopf's own kubeconfig reader,
    which reads $KUBECONFIG as it is now (the client read it at its import)."""
    failures = []
    for way in (kopf.login_via_client, kopf.login_with_kubeconfig):
        try:
            info = way(settings=settings, logger=log)
        except Exception as error:  # noqa: BLE001 - the next way may work
            failures.append(f"{way.__name__}: {error}")
            continue
        if info is not None:
            return info
    raise kopf.LoginError("no credentials: neither a service account nor a kubeconfig ("
                          + "; ".join(failures) + ")")


@kopf.on.login(id="login")
async def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    # In a thread: a kubeconfig's exec plugin may run for seconds.
    return await asyncio.to_thread(_login, settings)


def _configure_kopf(settings: kopf.OperatorSettings) -> None:
    settings.posting.enabled = False  # the passes post the job's events, kopf none
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.scanning.disabled = True  # no CRD or namespace watching, and no RBAC for it
    settings.queueing.idle_timeout = WORKER_IDLE_SECONDS
    settings.watching.chunk_size = LIST_CHUNK
    for group, plural, _, selector in OWNED.values():  # filtered on the server
        settings.watching.label_selectors[group, plural] = selector


async def _follow_peering(settings: kopf.OperatorSettings, memo: kopf.Memo,
                          controller: Controller, presence: Presence) -> asyncio.Task:
    """With peering on, no pass runs until the peering object shows this replica active; the
    report Service sends to it only then (report_presence.py)."""
    kube, name = controller.kube, settings.peering.name
    namespaces = memo.get("namespaces") or []
    await kube.ensure_peering(name, namespaces)
    controller.set_active(False)

    def on_change(paused: bool) -> None:
        controller.set_active(not paused)
        presence.set(active=not paused)

    follower = PeeringFollower(lambda: kube.read_peering(name, namespaces),
                               memo.get("identity") or "", settings.peering.priority,
                               on_change=on_change)
    return asyncio.create_task(follower.run(), name="peering follower")


@kopf.on.startup(id="configure")
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **indexes: Any) -> None:
    """The controller, started with kopf's indexes, kept in kopf's operator memo (every
    handler's `memo` is a copy of it), with everything that serves beside it."""
    # Bad report endpoint settings stop the start-up here, naming the variable (ValueError).
    reporting = read_report_settings(os.environ, _account_namespace())
    _configure_kopf(settings)
    kube = await asyncio.to_thread(Kube)
    controller = Controller(kube, Reconciler(
        kube, progress_write_seconds=reporting.progress_write_seconds), kueue=KUEUE_ENABLED,
        namespaces=memo.get("namespaces") or [])
    if KUEUE_ENABLED:
        # v1beta2 where served (Kueue >= 0.15; v0.20 serves nothing else), else v1beta1; kopf
        # watches the preferred version itself, and the pure code reads both shapes.
        version = await controller.kube.discover_kueue_version()
        log.info("Kueue integration on: Workloads %s", version or "not served (Kueue absent)")
    presence = memo.presence = Presence(controller.kube, reporting.namespace, reporting.pod)
    if settings.peering.mandatory and not settings.peering.standalone:
        memo.follower = await _follow_peering(settings, memo, controller, presence)
    presence.set(active=controller.active)  # a label left by a restart goes
    controller.start({name: index for name, index in indexes.items()
                      if isinstance(index, kopf.Index)})
    memo.controller = controller
    memo.reports = asyncio.create_task(_serve_reports(memo, controller, reporting, presence),
                                       name="report endpoint")
    port = os.environ.get("ACCELERATE_OPERATOR_METRICS_PORT")
    if port:
        metrics.count_jobs_from(controller.job_bodies)
        metrics.start_metrics_server(int(port))  # once per process, across kopf runs in tests


def _account_namespace() -> str | None:
    try:
        with open(f"{SERVICE_ACCOUNT_DIR}/namespace", encoding="utf-8") as file:
            return file.read().strip() or None
    except OSError:
        return None


async def _serve_reports(memo: kopf.Memo, controller: Controller, settings: ReportSettings,
                         presence: Presence) -> None:
    """The report endpoint (report_server.py) with its TLS (report_keeper.py). A start that
    fails (the Secret cannot be read or written yet) is tried again; the passes run meanwhile,
    and the pods retry their reports. Once it serves, every job's pass brings its ConfigMap the
    CA bundle, and again whenever the bundle is renewed."""
    keeper = CertKeeper(controller.kube, settings.namespace, settings.secret,
                        list(settings.names))
    while True:
        try:
            context = await keeper.start()
            keys = IssuerKeys(controller.kube.read_issuer, time.monotonic)
            server = ReportServer(lambda: controller, keys)
            port = await server.start("0.0.0.0", settings.port, context)
            break
        except Exception as error:  # noqa: BLE001 - logged, tried again
            log.error("the report endpoint cannot start (tried again in %.0f s): %r",
                      REPORT_RETRY_SECONDS, error)
            await asyncio.sleep(REPORT_RETRY_SECONDS)
    memo.report_server = server
    presence.set(serving=True)
    keeper.on_new_bundle = lambda: controller.use_report_endpoint(settings.endpoint,
                                                                  lambda: keeper.bundle)
    keeper.on_new_bundle()
    log.info("report endpoint on port %d, reached by the pods at %s", port,
             settings.endpoint.base_url)
    await keeper.run()


@kopf.on.cleanup(id="stop")
async def stop(memo: kopf.Memo, **_: Any) -> None:
    for name in ("reports", "follower"):
        task = memo.get(name)
        if task is not None:
            task.cancel()
    if memo.get("presence") is not None:
        memo.presence.stop()
    if memo.get("report_server") is not None:
        await memo.report_server.stop()
    if memo.get("controller") is not None:
        await memo.controller.stop()


@kopf.on.probe(id="jobs")
async def probe(memo: kopf.Memo, **_: Any) -> dict[str, Any]:
    """kopf's liveness endpoint answers only while its event loop does; this adds what the
    operator holds."""
    controller = memo.get("controller")
    if controller is None:
        return {"started": False}
    return {"jobs": len(controller.states), "queued": len(controller.queue),
            "paused": controller.queue.paused, "passes": controller.queue.passes}


def _hands_over(kind: str):
    """kopf's `when=` filter for one kind: kopf invokes no handler for an event it rejects."""
    def when(type: str | None, body: kopf.Body, **_: Any) -> bool:  # noqa: A002
        return hands_over(kind, type, body)
    return when


def _hand(kind: str, event_type: str | None, body: kopf.Body, memo: kopf.Memo) -> None:
    controller = memo.get("controller")
    if controller is not None:
        controller.on_event(kind, event_type, body)


# ---- indexes: what a pass reads, by (namespace, job name) ---------------------------------------
@kopf.index(GROUP, PLURAL, id="job_bodies")
async def job_bodies(body: kopf.Body, namespace: str, name: str, **_: Any) -> dict:
    return {(namespace or "", name): job_entry(body)}


@kopf.index("v1", "pods", id="job_pods")
async def job_pods(body: kopf.Body, meta: Mapping[str, Any], **_: Any) -> dict | None:
    key = owning_job(meta)
    return {key: pod_entry(body)} if key and not is_placeholder(meta) else None


@kopf.index("v1", "pods", id="job_placeholders")
async def job_placeholders(body: kopf.Body, meta: Mapping[str, Any],
                           **_: Any) -> dict | None:
    key = owning_job(meta)
    return {key: pod_entry(body)} if key and is_placeholder(meta) else None


@kopf.index("v1", "services", id="job_services")
async def job_services(meta: Mapping[str, Any], name: str, **_: Any) -> dict | None:
    key = owning_job(meta)
    return {key: name} if key else None


@kopf.index("v1", "configmaps", id="job_configmaps")
async def job_configmaps(body: kopf.Body, meta: Mapping[str, Any], **_: Any) -> dict | None:
    key = owning_job(meta)
    return {key: configmap_entry(body)} if key else None


@kopf.index("policy", "poddisruptionbudgets", id="job_pdbs")
async def job_pdbs(meta: Mapping[str, Any], name: str, **_: Any) -> dict | None:
    key = owning_job(meta)
    return {key: name} if key else None


if KUEUE_ENABLED:
    @kopf.index(KUEUE_GROUP, "workloads", id="job_workloads")
    async def job_workloads(body: kopf.Body, meta: Mapping[str, Any], **_: Any) -> dict | None:
        key = owning_job(meta)
        return {key: workload_entry(body)} if key else None

    @kopf.on.event(KUEUE_GROUP, "workloads", id="workload_events",
                   when=_hands_over("Workload"))
    async def workload_events(type: str | None, body: kopf.Body, memo: kopf.Memo,  # noqa: A002
                              **_: Any) -> None:
        _hand("Workload", type, body, memo)


# ---- events: handed to the controller, filtered by its one rule (_hands_over) --------------------
@kopf.on.event(GROUP, PLURAL, id="job_events", when=_hands_over("AccelerateJob"))
async def job_events(type: str | None, body: kopf.Body, memo: kopf.Memo,  # noqa: A002
                     **_: Any) -> None:
    _hand("AccelerateJob", type, body, memo)


@kopf.on.event("v1", "pods", id="pod_events", when=_hands_over("Pod"))
async def pod_events(type: str | None, body: kopf.Body, memo: kopf.Memo,  # noqa: A002
                     **_: Any) -> None:
    _hand("Pod", type, body, memo)


@kopf.on.event("v1", "services", id="service_events", when=_hands_over("Service"))
async def service_events(type: str | None, body: kopf.Body, memo: kopf.Memo,  # noqa: A002
                         **_: Any) -> None:
    _hand("Service", type, body, memo)


@kopf.on.event("policy", "poddisruptionbudgets", id="pdb_events",
               when=_hands_over("PodDisruptionBudget"))
async def pdb_events(type: str | None, body: kopf.Body, memo: kopf.Memo,  # noqa: A002
                     **_: Any) -> None:
    _hand("PodDisruptionBudget", type, body, memo)


@kopf.on.event("v1", "configmaps", id="configmap_events", when=_hands_over("ConfigMap"))
async def configmap_events(type: str | None, body: kopf.Body, memo: kopf.Memo,  # noqa: A002
                           **_: Any) -> None:
    _hand("ConfigMap", type, body, memo)
