"""The work queue (workqueue.py) on a real event loop: a key's events merge into one pass, one
pass per key at a time (a key added while its pass runs is run once more after it), passes of
different keys run side by side, "requeue after" keeps the earliest request, a failed pass is
retried with a doubling backoff and counted (num_requeues) until one succeeds, and a paused
queue runs nothing until it resumes."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

import pytest
from accelerate_operator import workqueue
from accelerate_operator.workqueue import WorkQueue


class Passes:
    """A pass that records each run (key, start, end) and how many ran at once per key; it can
    be held open, raise, or ask to be requeued."""

    def __init__(self) -> None:
        self.runs: list[tuple[Hashable, float, float]] = []
        self.running: dict[Hashable, int] = {}
        self.most_at_once: dict[Hashable, int] = {}
        self.most_keys_at_once = 0
        self.hold: dict[Hashable, asyncio.Event] = {}
        self.fail: dict[Hashable, int] = {}  # how many more runs of the key raise
        self.requeue: dict[Hashable, list[float | None]] = {}

    async def __call__(self, key: Hashable) -> float | None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.running[key] = self.running.get(key, 0) + 1
        self.most_at_once[key] = max(self.most_at_once.get(key, 0), self.running[key])
        self.most_keys_at_once = max(self.most_keys_at_once,
                                     sum(1 for n in self.running.values() if n))
        try:
            await asyncio.sleep(0)
            if key in self.hold:
                await self.hold[key].wait()
            if self.fail.get(key, 0) > 0:
                self.fail[key] -= 1
                raise RuntimeError(f"pass of {key} failed")
            wanted = self.requeue.get(key) or [None]
            return wanted.pop(0)
        finally:
            self.running[key] -= 1
            self.runs.append((key, start, loop.time()))

    def count(self, key: Hashable) -> int:
        return sum(1 for k, *_ in self.runs if k == key)


def run(scenario) -> None:
    """Run `scenario(queue, passes)` with a started queue of 4 workers, then stop it."""
    async def main() -> None:
        passes = Passes()
        queue = WorkQueue(passes, workers=4)
        queue.start()
        try:
            await scenario(queue, passes)
        finally:
            await queue.stop()
    asyncio.run(main())


async def settle(seconds: float = 0.05) -> None:
    await asyncio.sleep(seconds)


def test_events_of_one_key_before_its_pass_merge_into_one_pass():
    async def scenario(queue: WorkQueue, passes: Passes) -> None:
        for _ in range(5):
            queue.add("job")
        queue.add("other")
        await settle()
        assert passes.count("job") == 1 and passes.count("other") == 1
        assert len(queue) == 0 and queue.passes == 2
    run(scenario)


def test_a_key_added_while_its_pass_runs_runs_once_more_after_it_never_alongside():
    async def scenario(queue: WorkQueue, passes: Passes) -> None:
        passes.hold["job"] = asyncio.Event()
        queue.add("job")
        await settle()
        for _ in range(3):
            queue.add("job")
        await settle()
        assert passes.running["job"] == 1 and passes.count("job") == 0
        passes.hold["job"].set()
        await settle()
        assert passes.count("job") == 2
        assert passes.most_at_once["job"] == 1
        first, second = [run_ for run_ in passes.runs if run_[0] == "job"]
        assert second[1] >= first[2]  # the second started after the first had ended
    run(scenario)


def test_passes_of_different_keys_run_side_by_side():
    async def scenario(queue: WorkQueue, passes: Passes) -> None:
        gate = asyncio.Event()
        passes.hold.update({"a": gate, "b": gate, "c": gate})
        for key in "abc":
            queue.add(key)
        await settle()
        assert passes.most_keys_at_once == 3
        gate.set()
        await settle()
        assert [passes.count(key) for key in "abc"] == [1, 1, 1]
    run(scenario)


def test_a_pass_asking_to_be_requeued_runs_again_after_that_long():
    async def scenario(queue: WorkQueue, passes: Passes) -> None:
        passes.requeue["job"] = [0.2, None]
        queue.add("job")
        await settle(0.1)
        assert passes.count("job") == 1
        await settle(0.25)
        assert passes.count("job") == 2
        first, second = [run_ for run_ in passes.runs if run_[0] == "job"]
        assert second[1] - first[2] >= 0.19
        await settle(0.3)
        assert passes.count("job") == 2  # the second asked for nothing
    run(scenario)


@pytest.mark.parametrize("delays", [(5.0, 0.1), (0.1, 5.0)], ids=["later-first", "earlier-first"])
def test_requeue_after_keeps_only_the_earliest_request(delays):
    async def scenario(queue: WorkQueue, passes: Passes) -> None:
        for delay in delays:
            queue.add_after("job", delay)
        await settle(0.05)
        assert passes.count("job") == 0
        await settle(0.15)
        assert passes.count("job") == 1
        assert len(queue) == 0  # nothing left waiting for 5 s
    run(scenario)


def test_a_failing_pass_is_retried_with_a_doubling_backoff_and_counted_until_it_succeeds(
        monkeypatch):
    monkeypatch.setattr(workqueue, "BACKOFF_FIRST_SECONDS", 0.05)

    async def scenario(queue: WorkQueue, passes: Passes) -> None:
        passes.fail["job"] = 3
        counts = []
        queue.add("job")
        for _ in range(60):
            await settle(0.01)
            if not counts or counts[-1] != queue.num_requeues("job"):
                counts.append(queue.num_requeues("job"))
        assert passes.count("job") == 4
        assert counts == [1, 2, 3, 0]  # failures in a row, reset by the pass that succeeded
        starts = [start for key, start, _ in passes.runs if key == "job"]
        gaps = [later - earlier for earlier, later in zip(starts, starts[1:], strict=False)]
        assert gaps[0] >= 0.05 and gaps[1] >= 0.1 and gaps[2] >= 0.2
    run(scenario)


def test_the_backoff_stops_growing_at_its_cap(monkeypatch):
    monkeypatch.setattr(workqueue, "BACKOFF_FIRST_SECONDS", 0.02)
    monkeypatch.setattr(workqueue, "BACKOFF_MAX_SECONDS", 0.05)

    async def scenario(queue: WorkQueue, passes: Passes) -> None:
        delays = []
        requeue = queue.add_after
        queue.add_after = lambda key, seconds: (delays.append(seconds), requeue(key, seconds))
        passes.fail["job"] = 5
        queue.add("job")
        for _ in range(200):  # the delays, not how many passes a loaded machine fits in a time
            if passes.count("job") == 6:
                break
            await settle(0.05)
        assert delays == [0.02, 0.04, 0.05, 0.05, 0.05]
    run(scenario)


def test_a_paused_queue_runs_no_pass_and_runs_the_waiting_ones_once_resumed():
    async def scenario(queue: WorkQueue, passes: Passes) -> None:
        queue.paused = True
        queue.add("job")
        queue.add_after("later", 0.05)
        await settle(0.2)
        assert passes.runs == [] and queue.paused
        queue.paused = False
        await settle()
        assert passes.count("job") == 1 and passes.count("later") == 1
    run(scenario)


def test_a_forgotten_key_has_nothing_left_queued():
    async def scenario(queue: WorkQueue, passes: Passes) -> None:
        passes.fail["job"] = 1
        queue.add("job")
        await settle()
        assert queue.num_requeues("job") == 1  # its retry waits on the backoff
        queue.forget("job")
        assert queue.num_requeues("job") == 0 and len(queue) == 0
        await settle(1.2)
        assert passes.count("job") == 1
    run(scenario)
