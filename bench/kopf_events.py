"""kopf's own CPU per watch event, on events recorded from the real cluster, and what the
proposed upstream changes to kopf would save (docs/benchmarks.md, "Where the CPU goes, on the
CPU clock").

Why in-process: a py-spy profile of the running operator samples wall time on a 2-core machine
shared with the API server, so it overstates whatever runs while the process waits for a core.
Here each event is put through kopf's own per-event processor (`process_resource_event`, what its
watch workers call) and timed with the process's CPU clock, R rounds.

1. Record (the operator running, as `make cluster-up` leaves it): N two-node jobs with Pending
   pods (bench/throughput.py's template) in a fresh namespace; every watch event of the jobs,
   their pods, Services and ConfigMaps (with the operator's label selectors), until the last
   has been quiet for 3 s; the namespace is deleted. Printed: the events per job, by kind and type.
2. Replay, in-process, against a kopf registry with the operator's shape of handlers (for each
   kind one `@kopf.index` and one `@kopf.on.event` with a `when` filter; the handlers themselves
   do nothing, so what is timed is kopf's work, not ours), four ways:
   - kopf's defaults (its diff-base: a deep copy of each body, twice, per event);
   - the operator's settings (`handlers.NoDiffBase`, what the operator runs);
   - the proposed change: `watch_only_event` below, kopf's processor for a resource kind that
     has only indexers and on-event handlers (kopf's registry knows it), which skips what such
     a kind never uses: the diff-base, cause detection for changes and daemons, a third logger,
     the finalizer checks and the apply of an empty patch. Same indexes, same handler calls;
   - that, and each cause's handler kwargs built once (`kwargs_once_per_cause`).
   Each with the on-event handlers filtered out by `when` (as the operator's filters do for
   about half the events) and invoked; and, for scale, the two bare handler functions called
   directly. The ratio column is to kopf's defaults.

Usage: python bench/kopf_events.py [--jobs 40] [--rounds 30] [--events FILE]
       (--events FILE: replay a recording instead of recording; --save FILE: keep the recording)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import kopf
from accelerate_operator.constants import GROUP, PLURAL, VERSION
from accelerate_operator.controller import CONFIGMAP_SELECTOR, POD_SELECTOR, SERVICE_SELECTOR
from accelerate_operator.handlers import NoDiffBase
from common import Cluster, emit_result, machine_line, start_watchers, stop_watchers
from kopf._cogs.structs import bodies, patches, references
from kopf._core.actions import application, invocation, lifecycles, loggers, throttlers
from kopf._core.engines import indexing, posting
from kopf._core.intents import causes, registries
from kopf._core.reactor import inventory, processing
from throughput import job_body

RESOURCES = {
    "acceleratejobs": references.Resource(GROUP, VERSION, PLURAL, kind="AccelerateJob",
                                          namespaced=True),
    "pods": references.Resource("", "v1", "pods", kind="Pod", namespaced=True),
    "services": references.Resource("", "v1", "services", kind="Service", namespaced=True),
    "configmaps": references.Resource("", "v1", "configmaps", kind="ConfigMap", namespaced=True),
}


# ---- 1. recording ------------------------------------------------------------------------------
def record(cluster: Cluster, jobs: int, quiet: float = 3.0, limit: float = 180.0
           ) -> list[tuple[str, str, dict]]:
    namespace = cluster.create_namespace("bench-kopf-events")
    events: list[tuple[str, str, dict]] = []
    last = [time.monotonic()]
    lock = threading.Lock()

    def on_event(t: float, kind: str, typ: str, obj: dict) -> None:
        with lock:
            events.append((kind, typ, obj))
            last[0] = t

    # The operator's own label selectors (handlers.py): the events its watches get.
    watchers = start_watchers(cluster, namespace, on_event, selectors={
        "pods": POD_SELECTOR, "services": SERVICE_SELECTOR, "configmaps": CONFIGMAP_SELECTOR})
    try:
        for i in range(jobs):
            cluster.create_job(job_body(namespace, f"job-{i}", "pending"))
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            time.sleep(0.5)
            with lock:
                statused = {obj["metadata"]["name"] for kind, _, obj in events
                            if kind == "acceleratejobs" and obj.get("status")}
                settled = time.monotonic() - last[0] > quiet
            if len(statused) == jobs and settled:
                break
        else:
            raise TimeoutError(f"{jobs} jobs did not settle in {limit:.0f} s")
    finally:
        stop_watchers(watchers)
        cluster.delete_namespace(namespace, wait=False)
    return events


def events_per_job(events: list[tuple[str, str, dict]], jobs: int) -> dict[str, float]:
    counts = collections.Counter(f"{kind} {typ}" for kind, typ, _ in events)
    return {key: round(n / jobs, 2) for key, n in sorted(counts.items())}


# ---- 2. the proposed change to kopf ------------------------------------------------------------
def watch_only(registry: registries.OperatorRegistry, resource: references.Resource) -> bool:
    """A kind served only by indexers and on-event handlers: kopf keeps no state for it."""
    return not (registry._changing.has_handlers(resource=resource)
                or registry._spawning.has_handlers(resource=resource))


async def watch_only_event(
        lifecycle: Any, indexers: indexing.OperatorIndexers,
        registry: registries.OperatorRegistry, settings: kopf.OperatorSettings,
        memories: inventory.ResourceMemories, memobase: Any, resource: references.Resource,
        raw_event: bodies.RawEvent, event_queue: posting.K8sEventQueue,
        stream_pressure: asyncio.Event | None = None, operator_paused: Any = None,
        resource_indexed: Any = None, operator_indexed: Any = None,
        consistency_time: float | None = None, no_throttling: bool = False) -> str | None:
    """kopf 1.45's `process_resource_event` for a watch-only kind: the same indexing, the same
    on-event handler calls with the same kwargs, the same error throttling; none of the
    diff-base, the changing/spawning cause detection, the ObjectLogger for posted events, the
    finalizer checks, or `application.apply` when no handler patched. A kind with a leftover
    kopf finalizer or a remaining patch takes kopf's full path, which removes or applies it.
    Upstream, `watch_only` would be decided once per watched kind, not per event."""
    raw_body = raw_event["object"]
    finalizers = raw_body.get("metadata", {}).get("finalizers") or ()
    memory = await memories.recall(raw_body, noticed_by_listing=raw_event["type"] is None,
                                   memobase=memobase)
    if (memory.remaining_patch or settings.persistence.finalizer in finalizers
            or not watch_only(registry, resource)):
        return await processing.process_resource_event(
            lifecycle=lifecycle, indexers=indexers, registry=registry, settings=settings,
            memories=memories, memobase=memobase, resource=resource, raw_event=raw_event,
            event_queue=event_queue, stream_pressure=stream_pressure,
            operator_paused=operator_paused, resource_indexed=resource_indexed,
            operator_indexed=operator_indexed, consistency_time=consistency_time,
            no_throttling=no_throttling)
    if raw_event["type"] == "DELETED":
        await memories.forget(raw_body)
    body = bodies.Body(raw_body)
    local_logger = loggers.LocalObjectLogger(body=body, settings=settings)
    throttled = contextlib.nullcontext(True) if no_throttling else throttlers.throttled(
        throttler=memory.error_throttler, logger=local_logger,
        delays=settings.queueing.error_delays, wakeup=stream_pressure)
    async with throttled as should_run:
        if not should_run:
            return None
        posting.event_queue_loop_var.set(asyncio.get_running_loop())
        posting.event_queue_var.set(event_queue)
        await indexing.index_resource(
            registry=registry, indexers=indexers, settings=settings, resource=resource,
            raw_event=raw_event, body=body, memo=memory.memo, memory=memory.indexing_memory,
            logger=loggers.TerseObjectLogger(body=body, settings=settings))
        if operator_indexed is not None and resource_indexed is not None:
            await operator_indexed.drop_toggle(resource_indexed)
        if operator_indexed is not None:
            await operator_indexed.wait_for(True)
        if not registry._watching.has_handlers(resource=resource):
            return None
        patch = patches.Patch(body=body)
        await processing.process_watching_cause(
            lifecycle=lifecycles.all_at_once, registry=registry, settings=settings,
            cause=causes.detect_watching_cause(
                raw_event=raw_event, resource=resource, indices=indexers.indices,
                logger=local_logger, patch=patch, body=body, memo=memory.memo))
        if not patch or raw_event["type"] == "DELETED":
            return None
        applied, version, memory.remaining_patch = await application.apply(
            settings=settings, resource=resource, body=body, patch=patch,
            logger=local_logger, delays=[], stream_pressure=stream_pressure)
        return version


@contextlib.contextmanager
def kwargs_once_per_cause():
    """The second proposed change, for the replay only: a cause's handler kwargs (body, spec,
    meta, status, uid, name, namespace, labels, annotations, the indexes...) built once per
    cause. kopf 1.45 builds them again for the lifecycle, for each `when`/label filter and for
    each handler call: 5 times per event here. A cause lives for one event and its fields do not
    change, so the dict can be kept on it (each caller gets a copy)."""
    cls = invocation.Kwargable
    saved = {name: cls.__dict__[name] for name in ("kwargs", "sync_kwargs", "async_kwargs")}

    def once(name: str, build: property) -> property:
        def get(self: Any) -> dict[str, Any]:
            cache = self.__dict__.setdefault("_kwargs_once", {})
            if name not in cache:
                cache[name] = build.fget(self)
            return dict(cache[name])
        return property(get)
    for name, build in saved.items():
        setattr(cls, name, once(name, build))
    try:
        yield
    finally:
        for name, build in saved.items():
            setattr(cls, name, build)


# ---- 3. the replay ----------------------------------------------------------------------------
def operator_shaped_registry(handler_runs: bool) -> registries.OperatorRegistry:
    """For each kind the operator watches, an index and an on-event handler behind a `when`
    filter, as handlers.py registers them; the handlers return at once."""
    registry = registries.OperatorRegistry()

    def key_of(meta: Any, **_: Any) -> tuple[str, str]:
        return (meta.get("namespace") or "", meta.get("name"))

    for kind, resource in RESOURCES.items():
        async def index(meta: Any, **_: Any) -> dict:
            return {key_of(meta): None}

        async def on_event(**_: Any) -> None:
            return None

        kopf.index(resource.group, resource.version, resource.plural, id=f"{kind}_index",
                   registry=registry)(index)
        kopf.on.event(resource.group, resource.version, resource.plural, id=f"{kind}_events",
                      registry=registry, when=lambda **_: handler_runs)(on_event)
    return registry


async def replay(events: list[tuple[str, str, dict]], processor: Any, diff_base: bool,
                 handler_runs: bool, rounds: int, kwargs_once: bool = False) -> list[float]:
    """CPU seconds per event, one figure per round."""
    if kwargs_once:
        with kwargs_once_per_cause():
            return await replay(events, processor, diff_base, handler_runs, rounds)
    settings = kopf.OperatorSettings()
    settings.posting.enabled = False
    if not diff_base:
        settings.persistence.diffbase_storage = NoDiffBase()
    registry = operator_shaped_registry(handler_runs)
    per_event = []
    for _ in range(rounds):
        indexers = indexing.OperatorIndexers()
        indexers.ensure(registry._indexing.get_all_handlers())
        memories = inventory.ResourceMemories()
        queue: asyncio.Queue = asyncio.Queue()
        raw = [(RESOURCES[kind], {"type": typ, "object": json.loads(json.dumps(obj))})
               for kind, typ, obj in events]  # fresh bodies: kopf's memories key on them
        started = time.process_time()
        for resource, raw_event in raw:
            await processor(lifecycle=lifecycles.asap, indexers=indexers, registry=registry,
                            settings=settings, memories=memories, memobase=kopf.Memo(),
                            resource=resource, raw_event=raw_event, event_queue=queue,
                            no_throttling=False)
        per_event.append((time.process_time() - started) / len(raw))
    return per_event


async def bare_handlers(events: list[tuple[str, str, dict]], rounds: int) -> list[float]:
    """The two handler bodies of handlers.py's shape called directly: the floor."""
    async def index(meta: Any) -> dict:
        return {(meta.get("namespace") or "", meta.get("name")): None}

    async def on_event() -> None:
        return None
    per_event = []
    for _ in range(rounds):
        started = time.process_time()
        for _, _, obj in events:
            await index(obj["metadata"])
            await on_event()
        per_event.append((time.process_time() - started) / len(events))
    return per_event


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--events", help="replay this recording (JSON lines) instead")
    parser.add_argument("--save", help="keep the recording here (JSON lines)")
    parser.add_argument("--json", help="append the result as a JSON line to this file")
    args = parser.parse_args()

    if args.events:
        lines = Path(args.events).read_text().splitlines()
        jobs = json.loads(lines[0])["jobs"]
        events = [tuple(json.loads(line)) for line in lines[1:]]
    else:
        print(f"kopf_events: {machine_line()}")
        jobs = args.jobs
        events = record(Cluster(), jobs)
        if args.save:
            with open(args.save, "w") as out:
                out.write(json.dumps({"jobs": jobs}) + "\n")
                out.writelines(json.dumps(event) + "\n" for event in events)
    per_job = events_per_job(events, jobs)
    print(f"recorded {len(events)} watch events of {jobs} two-node Pending jobs: "
          f"{len(events) / jobs:.2f} per job {per_job}")

    logging_quiet()
    variants = [
        ("kopf defaults (diff-base)", processing.process_resource_event, True, False),
        ("operator settings (NoDiffBase)", processing.process_resource_event, False, False),
        ("proposed: watch-only path", watch_only_event, False, False),
        ("proposed: + kwargs once per cause", watch_only_event, False, True),
    ]
    result: dict[str, Any] = {"jobs": jobs, "events_per_job": round(len(events) / jobs, 2),
                              "by_kind": per_job, "us_per_event": {}}
    for handler_runs in (False, True):
        title = "on-event handler invoked" if handler_runs else "on-event handler filtered by when="
        print(f"  {title}: CPU per event, median of {args.rounds} rounds (min-max)")
        baseline = None
        for name, processor, diff_base, kwargs_once in variants:
            runs = asyncio.run(replay(events, processor, diff_base, handler_runs, args.rounds,
                                      kwargs_once))
            median = statistics.median(runs)
            baseline = baseline or median
            print(f"    {name:34s} {median * 1e6:7.1f} us ({min(runs) * 1e6:.1f}-"
                  f"{max(runs) * 1e6:.1f}), {median * len(events) / jobs * 1e3:.2f} ms per job,"
                  f" {median / baseline:.2f}x")
            result["us_per_event"].setdefault(name, {})[
                "invoked" if handler_runs else "filtered"] = round(median * 1e6, 1)
    floor = statistics.median(asyncio.run(bare_handlers(events, args.rounds)))
    print(f"  the handler bodies alone: {floor * 1e6:.1f} us per event")
    result["us_per_event"]["handler bodies alone"] = round(floor * 1e6, 1)
    emit_result("kopf_events", result, args.json)


def logging_quiet() -> None:
    """kopf's loggers at the operator's level (__main__): warnings and errors only."""
    import logging
    logging.getLogger("kopf").setLevel(logging.WARNING)


if __name__ == "__main__":
    main()
